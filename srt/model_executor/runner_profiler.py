"""The runner profiling itself on request: `torch.profiler` over its next steps, as a server runs
them (overlapped, batches as the traffic makes them), which `srt.bench.one_batch --profile`
cannot show. `/start_profile` begins it (at most `num_steps` steps, or until `/stop_profile`);
the trace goes to `output_dir` (default `$SRT_PROFILE_DIR`, else the temporary directory) as
`srt-runner-<time>-<pid>-<n>.trace.json.gz` (the runner's n-th), and its summary
(`srt.profiling.summarize_trace`) comes back with the stop: per step the launch's host ms
(each launch is annotated), the device's busy ms and kernels, the device's span, the top
kernels and host calls.

A profile's start and end each wait for the steps in flight (the trace then holds whole
steps): the pipeline drains twice, and the profiler's own cost slows the host; the steps
between are what it is for. A profile that ends by its step count is written when it is
asked for (`/stop_profile`, or the next `/start_profile`), not there: writing and
summarising a trace takes seconds, which the steps after it would wait.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from srt.ipc.reports import ProfileOutcome
from srt.profiling import profiler_for, summarize_trace

LAUNCH_ANNOTATION = "srt_runner_launch"
TOP = 15  # kernels, host ops and runtime calls in the summary
_NOT_RECORDING = contextlib.nullcontext()  # reentrant: one serves every launch


class RunnerProfiler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.profiler: Any = None  # torch.profiler.profile while recording
        self.unwritten: Any = None  # one that ended by its step count, its trace not written
        self.trace: Path | None = None
        self.num_steps: int | None = None
        self.steps = 0
        self.last: ProfileOutcome | None = None  # the last profile's, once written
        self.started = 0  # profiles begun

    @property
    def recording(self) -> bool:
        return self.profiler is not None

    @property
    def due(self) -> bool:
        """Whether the profile has all the steps it asked for."""
        return self.recording and self.num_steps is not None and self.steps >= self.num_steps

    def outcome(self, message: str, error: str | None = None) -> ProfileOutcome:
        trace = str(self.trace) if self.trace is not None else None
        return ProfileOutcome(self.recording, self.steps, trace, message, error=error)

    def start(self, output_dir: str | None, num_steps: int | None) -> ProfileOutcome:
        """Begin recording (nothing if a profile is recording already). ValueError for a
        step count below 1 or a directory that cannot be made."""
        if self.recording:
            return self.outcome("a profile is recording already; /stop_profile ends it")
        self._write()  # the last one's, if it ended by its count: nothing is lost
        if num_steps is not None and num_steps < 1:
            raise ValueError(f"num_steps must be at least 1, got {num_steps}")
        directory = Path(output_dir or os.environ.get("SRT_PROFILE_DIR") or tempfile.gettempdir())
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot make the profile's directory {directory}: {e}") from e
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.started += 1
        name = f"srt-runner-{stamp}-{os.getpid()}-{self.started}.trace.json.gz"
        self.trace = directory / name
        self.num_steps, self.steps = num_steps, 0
        self.profiler = profiler_for(self.device)
        self.profiler.start()
        return self.outcome("recording")

    def step(self) -> contextlib.AbstractContextManager[Any]:
        """Around a step's launch: annotated and counted while recording; else nothing (every
        launch passes here: no generator is made for it)."""
        return self._recorded_step() if self.recording else _NOT_RECORDING

    @contextlib.contextmanager
    def _recorded_step(self) -> Iterator[None]:
        with torch.profiler.record_function(LAUNCH_ANNOTATION):
            yield
        self.steps += 1

    def finish(self) -> None:
        """End the recording once it has its steps (the caller has waited for them); its
        trace is written when asked for."""
        self.profiler.stop()
        self.profiler, self.unwritten = None, self.profiler

    def stop(self) -> ProfileOutcome:
        """End the recording (the caller has waited for its steps), write the trace, and
        say what it holds; without one recording, the last profile's outcome."""
        if self.recording:
            self.finish()
        self._write()
        return self.last or self.outcome("no profile recorded; /start_profile begins one")

    def _write(self) -> None:
        """Write the ended profile's trace and summarise it (`last`), if one waits."""
        if self.unwritten is None:
            return
        profiler, self.unwritten = self.unwritten, None
        assert self.trace is not None
        profiler.export_chrome_trace(str(self.trace))  # gzipped: the name ends in .gz
        with gzip.open(self.trace, "rt") as f:
            summary = summarize_trace(json.load(f), TOP, LAUNCH_ANNOTATION)
        self.last = ProfileOutcome(
            False, self.steps, str(self.trace), f"{self.steps} steps written", summary
        )
