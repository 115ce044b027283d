"""Per piece, per bucket state of one phase, and the pluggable specialisation step.

Every compilable piece of the split graph is called through a `Router` slot. While a phase
runner runs the model it routes the calls to its `BucketDispatcher` with the batch's bucket
(the token count it was padded to, or None beyond the largest bucket). For each (piece,
bucket) the dispatcher walks:

    unseen --first hit--> warm          ran the general graph (a warm-up: allocator, kernels)
    warm --second hit--> specialised    `specializer(...)` built the bucket's callable; ran it
    specialised --third hit--> replayed ... and every later hit replays it

Calls without a bucket always run the general graph (compiled once for the symbolic size).

The specialisation hook
-----------------------
`Specializer` is any callable

    specializer(piece: int, bucket: int, general: Callable, args: tuple) -> Callable

called once per (piece, bucket), on the bucket's second hit, inside the live forward (the
forward context of the batch is set). `piece` is the piece index (0 .. num_pieces - 1),
`bucket` the padded token count, `general` the piece's general compiled callable (eager FX or
Inductor; structurally identical pieces share one), `args` the piece's positional arguments of
this hit: tensors (activations, which are new tensors every hit, and the weights / buffers,
which are the same tensors every hit) and Python ints for the size symbols. It returns the
callable to use for this hit and every later hit of (piece, bucket): same arguments, same
return convention as `general`. Returning `general` itself declines (the bucket keeps running
the general graph); exceptions propagate. A CUDA-graph specializer captures `general(*args)`
here and returns a replay that copies later activation arguments into the captured inputs.
`run_general`, the default, declines: on the CPU the general graph is what runs.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

PieceFn = Callable[..., Any]


class Specializer(Protocol):
    def __call__(
        self, piece: int, bucket: int, general: PieceFn, args: tuple[Any, ...]
    ) -> PieceFn: ...


def run_general(piece: int, bucket: int, general: PieceFn, args: tuple[Any, ...]) -> PieceFn:
    """The default specializer: keep the general graph for every bucket."""
    return general


class BucketState(enum.IntEnum):
    UNSEEN = 0
    WARM = 1
    SPECIALISED = 2
    REPLAYED = 3

    def __str__(self) -> str:
        return self.name.lower()


@dataclass
class PieceBucket:
    state: BucketState = BucketState.UNSEEN
    hits: int = 0
    specialise_s: float = 0.0
    fn: PieceFn | None = None


class BucketDispatcher:
    """One phase's per-(piece, bucket) states over the shared general pieces."""

    def __init__(self, general: list[PieceFn], specializer: Specializer = run_general) -> None:
        self.general = general
        self.specializer = specializer
        self.entries: dict[tuple[int, int], PieceBucket] = {}
        self.general_runs = 0  # forwards without a bucket

    def run(self, piece: int, bucket: int | None, args: tuple[Any, ...]) -> Any:
        general = self.general[piece]
        if bucket is None:
            self.general_runs += piece == 0
            return general(*args)
        entry = self.entries.setdefault((piece, bucket), PieceBucket())
        entry.hits += 1
        if entry.state is BucketState.UNSEEN:
            entry.state = BucketState.WARM
            return general(*args)
        if entry.state is BucketState.WARM:
            start = time.perf_counter()
            entry.fn = self.specializer(piece, bucket, general, args)
            entry.specialise_s = time.perf_counter() - start
            entry.state = BucketState.SPECIALISED
        else:
            entry.state = BucketState.REPLAYED
        assert entry.fn is not None, "set when the bucket was specialised"
        return entry.fn(*args)

    def bucket_stats(self) -> dict[int, dict[str, Any]]:
        """Per bucket: the least advanced state of its pieces, its hits (forwards), and the
        seconds spent specialising its pieces."""
        stats: dict[int, dict[str, Any]] = {}
        for (_, bucket), entry in sorted(self.entries.items(), key=lambda kv: kv[0][::-1]):
            s = stats.setdefault(bucket, {"state": entry.state, "hits": 0, "specialise_s": 0.0})
            s["state"] = min(s["state"], entry.state)
            s["hits"] = max(s["hits"], entry.hits)
            s["specialise_s"] += entry.specialise_s
        for s in stats.values():
            s["state"] = str(s["state"])
            s["specialise_s"] = round(s["specialise_s"], 4)
        return stats


class Router:
    """The slots installed in the split graph in place of its compilable pieces."""

    def __init__(self) -> None:
        self.dispatcher: BucketDispatcher | None = None
        self.bucket: int | None = None
        self.fallback: list[PieceFn] = []  # the general pieces, for calls outside any phase

    @contextmanager
    def route(self, dispatcher: BucketDispatcher, bucket: int | None) -> Iterator[None]:
        self.dispatcher, self.bucket = dispatcher, bucket
        try:
            yield
        finally:
            self.dispatcher, self.bucket = None, None

    def slot(self, piece: int) -> PieceFn:
        def run_piece(*args: Any) -> Any:
            if self.dispatcher is None:
                return self.fallback[piece](*args)
            return self.dispatcher.run(piece, self.bucket, args)

        run_piece.__name__ = f"piece_{piece}"
        return run_piece
