"""Where a step's time goes: a few timestamps per step in a bounded ring, summarised on request.

Each process that handles steps (scheduler, runner, tokenizer) keeps one: marking costs one
`perf_counter` call and an array store, so it is always on; `/get_server_info` shows the
median gaps between consecutive marks over the last steps. Medians hide the rare long step, so
the scheduler and the runner also tag each step with its kind and batch (`tag`, `tag_plan`),
and the summary adds, per kind, the steps, their mean requests and tokens, the total time from
their start to the next step's and their own median gaps (a prefill's path to its first
token apart from the decodes'); with the process's CPU seconds (`cpu_s`), two answers tell
whether a process was busy all along (a client diffs them over a run).

A step may also carry measured durations that are not host marks (`durations`, set with
`record`): the runner's device time per step, busy, idle before it and their sum, from CUDA
events; the summary gives their means over the window and per kind (an idle device shows as
a mean, where a median of mostly-zero gaps would hide it), and per kind their medians too.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from srt.ipc.messages import BatchPlan
from srt.ipc.reports import StepKindSummary, TimelineSummary

PERIOD_QUANTILES = (10, 50, 90)  # each kind's spread of periods (`periods_ms`)
# Steps a timeline keeps: a bench's load window must fit (16,384 decode steps of 1.5 ms are 25
# s; a tokenizer's messages come faster), or its summary describes only the window's end, the
# tail where the batch drains. About 1 MB a timeline.
RING_STEPS = 16384


def _spread(periods: np.ndarray) -> dict[str, float]:
    """The PERIOD_QUANTILES of `periods` (ms), keyed p10, p50, p90."""
    values = np.percentile(periods, PERIOD_QUANTILES)
    return {f"p{q}": round(float(ms), 4) for q, ms in zip(PERIOD_QUANTILES, values, strict=True)}


class StepTimeline:
    def __init__(
        self, marks: tuple[str, ...], size: int = RING_STEPS, durations: tuple[str, ...] = ()
    ) -> None:
        self.marks = marks
        self.index = {name: i for i, name in enumerate(marks)}
        self.times = np.full((size, len(marks)), np.nan)
        self.durations = durations
        self.duration_index = {name: i for i, name in enumerate(durations)}
        self.measured = np.full((size, len(durations)), np.nan)  # milliseconds
        # Per step: its kind (an index into `kinds`, -1 untagged), requests and tokens.
        self.kinds: list[str] = []
        self.tags = np.full((size, 3), -1, dtype=np.int64)
        self.steps = 0  # steps begun; the current one's row is steps % size

    def begin(self, step: int | None = None) -> None:
        """Start a step, numbered `step` (default: the one after the last); its first mark is
        taken now. Step numbers must grow by one for `period_ms` to be between neighbours."""
        self.steps = self.steps + 1 if step is None else step
        row = self.times[self.steps % len(self.times)]
        row[:] = np.nan
        row[0] = time.perf_counter()
        self.tags[self.steps % len(self.times)] = -1
        self.measured[self.steps % len(self.times)] = np.nan

    def tag(self, kind: str, requests: int, tokens: int) -> None:
        """Say what the step just begun is: its kind (e.g. prefill, decode) and batch."""
        if kind not in self.kinds:
            self.kinds.append(kind)
        self.tags[self.steps % len(self.times)] = (self.kinds.index(kind), requests, tokens)

    def tag_plan(self, plan: BatchPlan) -> None:
        """`tag` the step just begun with a batch plan's mode and batch."""
        self.tag(plan.mode.name.lower(), plan.batch_size, plan.num_tokens)

    def discard(self) -> None:
        """Forget the step just begun (it turned out to do nothing)."""
        self.times[self.steps % len(self.times)] = np.nan
        self.tags[self.steps % len(self.times)] = -1
        self.steps -= 1

    def mark(self, name: str, step: int | None = None) -> None:
        """Take a mark of step `step` (default: the last begun), if it is still in the ring."""
        step = self.steps if step is None else step
        if self.steps - step < len(self.times):
            self.times[step % len(self.times), self.index[name]] = time.perf_counter()

    def record(self, name: str, step: int, ms: float) -> None:
        """Set duration `name` of step `step` (milliseconds), if the step is still in the ring."""
        if self.steps - step < len(self.times):
            self.measured[step % len(self.times), self.duration_index[name]] = ms

    def summary(self, since: float | None = None) -> TimelineSummary:
        """Median milliseconds from each mark to the next over the steps kept, and from one
        step's start to the next's (`period_ms`); a gap no step had is left out. `since` (a
        `time.perf_counter()` value, which on Linux is the same clock in every process)
        keeps only the steps begun from then on; `window_steps` says how many were summed."""
        cpu_s = round(time.process_time(), 3)
        kept = min(self.steps, len(self.times))
        # Oldest first, so that the period is taken between consecutive steps.
        order = (np.arange(self.steps - kept + 1, self.steps + 1)) % len(self.times)
        t, tags, measured = self.times[order], self.tags[order], self.measured[order]
        if since is not None:
            kept_rows = ~(t[:, 0] < since)  # a step begun before `since` is out (NaN rows stay)
            t, tags, measured = t[kept_rows], tags[kept_rows], measured[kept_rows]
        t = t * 1000.0
        period_ms, kinds = None, {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns
            gaps = self._gaps(t)
            means = self._means(measured)
            if len(t) > 1:
                periods = np.diff(t[:, 0])
                period_ms = round(float(np.nanmedian(periods)), 4)
                kinds = self._by_kind(t[:-1], tags[:-1], measured[:-1], periods)
        window = int(np.sum(~np.isnan(t[:, 0])))
        return TimelineSummary(self.steps, window, cpu_s, gaps, period_ms, kinds, means)

    def _means(
        self, measured: np.ndarray, average: Callable[[np.ndarray], Any] = np.nanmean
    ) -> dict[str, float]:
        """The mean (or another `average`) of each duration over the rows of `measured` that
        have it."""
        means = {}
        for i, name in enumerate(self.durations):
            mean = average(measured[:, i]) if len(measured) else np.nan
            if not np.isnan(mean):
                means[name] = round(float(mean), 4)
        return means

    def _gaps(self, t: np.ndarray) -> dict[str, float]:
        """Median milliseconds from each mark to the next over the rows of `t`; a gap no row
        had is left out."""
        gaps = {}
        for i in range(1, len(self.marks)):
            gap = np.nanmedian(t[:, i] - t[:, i - 1]) if len(t) else np.nan
            if not np.isnan(gap):
                gaps[f"{self.marks[i - 1]}_to_{self.marks[i]}"] = round(float(gap), 4)
        return gaps

    def _by_kind(
        self, t: np.ndarray, tags: np.ndarray, measured: np.ndarray, periods: np.ndarray
    ) -> dict[str, StepKindSummary]:
        """Per tagged kind: steps, mean requests and tokens, the milliseconds from their
        starts to the next step's (a long step, or the wait after it, counts in full), and
        their own median gaps (a prefill's path is not a decode's)."""
        out = {}
        for i, kind in enumerate(self.kinds):
            rows = (tags[:, 0] == i) & ~np.isnan(periods)
            if rows.any():
                out[kind] = StepKindSummary(
                    int(rows.sum()),
                    round(float(tags[rows, 1].mean()), 2),
                    round(float(tags[rows, 2].mean()), 2),
                    round(float(periods[rows].sum()), 3),
                    self._gaps(t[rows]),
                    self._means(measured[rows]),
                    _spread(periods[rows]),
                    self._means(measured[rows], np.nanmedian),
                )
        return out
