"""What the tools' command lines share: handing the parsed options on to the function a tool
runs, whose keyword arguments they are."""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from typing import Any


def keyword_options(ns: argparse.Namespace, fn: Callable[..., object]) -> dict[str, Any]:
    """The parsed options named as `fn`'s keyword-only parameters, by name: a tool whose
    options are its function's arguments passes them on without naming each twice. A
    parameter the command line has no option for keeps `fn`'s default."""
    return {
        p.name: getattr(ns, p.name)
        for p in inspect.signature(fn).parameters.values()
        if p.kind is p.KEYWORD_ONLY and hasattr(ns, p.name)
    }
