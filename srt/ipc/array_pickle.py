"""Messages whose numpy fields pickle as one buffer.

A plan, a result and a step's outputs cross a process boundary every step, and pickling a
numpy array costs some microseconds of machinery whatever its size: a plan of 16 small arrays
spent about 0.2 ms in `dumps` and `loads`, more than its bytes take to copy. A dataclass that
derives from `PackedArrays` pickles its array fields as one byte buffer (each field's bytes at
an 8-byte-aligned offset, with its dtype and shape), which a receiver views without copying,
read-only, and the other fields as they are. The buffer is a `pickle.PickleBuffer`, so that
with protocol 5 a large one travels out of band (channels.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pickle
from typing import Any, cast

import numpy as np

_ALIGN = 8


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class PackedArrays:
    """A dataclass mixin: array fields pickle as views into one buffer (see the module)."""

    def __reduce__(self) -> tuple[Any, ...]:
        arrays: list[tuple[str, str, tuple[int, ...], int]] = []
        parts: list[bytes] = []
        others: dict[str, Any] = {}
        offset = 0
        for name in _field_names(cast(Any, type(self))):  # a mixin of dataclasses
            value = getattr(self, name)
            if not isinstance(value, np.ndarray):
                others[name] = value
                continue
            data = value.tobytes()
            arrays.append((name, value.dtype.str, value.shape, offset))
            parts.append(data)
            pad = _aligned(len(data)) - len(data)
            if pad:
                parts.append(bytes(pad))
            offset += len(data) + pad
        blob = pickle.PickleBuffer(b"".join(parts))
        return _unpack, (type(self), arrays, blob, others)


@functools.cache
def _field_names(cls: type[Any]) -> tuple[str, ...]:
    """The fields of a `PackedArrays` dataclass, looked up once: `dataclasses.fields` costs
    about a microsecond per message."""
    return tuple(f.name for f in dataclasses.fields(cls))


def _unpack(
    cls: type[Any],
    arrays: list[tuple[str, str, tuple[int, ...], int]],
    blob: Any,
    others: dict[str, Any],
) -> Any:
    view = memoryview(blob).cast("B")
    obj = object.__new__(cls)  # as pickle restores a dataclass: its fields, no __init__
    obj.__dict__.update(others)
    for name, dtype, shape, offset in arrays:
        # math.prod, not np.prod: this runs per field per message, and numpy's costs µs.
        obj.__dict__[name] = np.frombuffer(view, dtype, math.prod(shape), offset).reshape(shape)
    return obj
