"""Shared pytest setup: the ``gpu`` marker, Triton's interpreter where there is triton but no
CUDA (so the kernel tests run on the CPU too), and tiny random-weight model fixtures."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is not None and "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        # On a machine without CUDA, Triton kernels run only under Triton's interpreter, which
        # must be on before any kernel is defined (srt's modules define theirs at import).
        os.environ["TRITON_INTERPRET"] = "1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA (skipped without it)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch  # only pay for the import when some selected test is gpu-marked

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make(arch="llama", **kwargs) -> Path``: a tiny checkpoint, built once per argument set.

    kwargs are those of ``srt.tools.make_tiny_model.make_tiny_model``. Tests must not modify the
    returned directory: it is shared by every test in the session.
    """
    from srt.tools.make_tiny_model import make_tiny_model

    built: dict[tuple, Path] = {}

    def make(arch: str = "llama", **kwargs) -> Path:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in built:
            built[key] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **kwargs)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def reference(tiny_llama: Path) -> list[list[int]]:
    """Greedy ids of the tiny llama, uncompiled (compile_helpers' prompts): what every compiled
    engine must reproduce."""
    from compile_helpers import greedy_ids

    from srt import Engine

    with Engine(model_path=str(tiny_llama), device="cpu", dtype="float32") as eng:
        return greedy_ids(eng)


@pytest.fixture
def graph_pass_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Graph passes a test registers leave the project's registry as it was."""
    from srt.compilation import graph_passes

    monkeypatch.setattr(graph_passes, "_passes", dict(graph_passes._passes))


@pytest.fixture(scope="module")
def partitions_on_the_cpu() -> Iterator[None]:
    """Inductor's scheduler takes every kernel for a GPU kernel, so it cuts the graph into
    partitions at the split ops on the CPU too (the partition mode's CPU tests). Module scope:
    a module's engines made with it are shared; it stays on until the module's last test, so
    a module runs its tests that need it after those that must not have it."""
    from torch._inductor.scheduler import BaseSchedulerNode

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BaseSchedulerNode, "is_gpu", lambda self: True)
        yield
