"""Where a step's time goes: a few timestamps per step in a bounded ring, summarised on request.

Each process that handles steps (scheduler, runner, tokenizer) keeps one: marking costs one
`perf_counter` call and an array store, so it is always on; `/get_server_info` shows the
median gaps between consecutive marks over the last steps.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import numpy as np


class StepTimeline:
    def __init__(self, marks: tuple[str, ...], size: int = 1024) -> None:
        self.marks = marks
        self.index = {name: i for i, name in enumerate(marks)}
        self.times = np.full((size, len(marks)), np.nan)
        self.steps = 0  # steps begun; the current one's row is steps % size

    def begin(self, step: int | None = None) -> None:
        """Start a step, numbered `step` (default: the one after the last); its first mark is
        taken now. Step numbers must grow by one for `period_ms` to be between neighbours."""
        self.steps = self.steps + 1 if step is None else step
        row = self.times[self.steps % len(self.times)]
        row[:] = np.nan
        row[0] = time.perf_counter()

    def discard(self) -> None:
        """Forget the step just begun (it turned out to do nothing)."""
        self.times[self.steps % len(self.times)] = np.nan
        self.steps -= 1

    def mark(self, name: str, step: int | None = None) -> None:
        """Take a mark of step `step` (default: the last begun), if it is still in the ring."""
        step = self.steps if step is None else step
        if self.steps - step < len(self.times):
            self.times[step % len(self.times), self.index[name]] = time.perf_counter()

    def summary(self, since: float | None = None) -> dict[str, Any]:
        """Median milliseconds from each mark to the next over the steps kept, and from one
        step's start to the next's (`period_ms`); a gap no step had is left out. `since` (a
        `time.perf_counter()` value, which on Linux is the same clock in every process)
        keeps only the steps begun from then on; `window_steps` says how many were summed."""
        kept = min(self.steps, len(self.times))
        if kept == 0:
            return {"steps": 0, "window_steps": 0}
        # Oldest first, so that the period is taken between consecutive steps.
        order = (np.arange(self.steps - kept + 1, self.steps + 1)) % len(self.times)
        t = self.times[order]
        if since is not None:
            t = t[~(t[:, 0] < since)]  # a step begun before `since` is out (NaN rows stay)
        t = t * 1000.0
        out: dict[str, Any] = {"steps": self.steps, "window_steps": int(np.sum(~np.isnan(t[:, 0])))}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns
            for i in range(1, len(self.marks)):
                gap = np.nanmedian(t[:, i] - t[:, i - 1])
                if not np.isnan(gap):
                    out[f"{self.marks[i - 1]}_to_{self.marks[i]}_ms"] = round(float(gap), 4)
            if len(t) > 1:
                out["period_ms"] = round(float(np.nanmedian(np.diff(t[:, 0]))), 4)
        return out
