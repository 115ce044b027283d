"""The device's own time per step, from CUDA events: busy from a step's first upload to its
result's copy to the host, and idle before it since the previous step's end. With both, a
served step's period splits into what the device did and how long it waited for the host (a
server slower than the runner alone is host-bound where idle is large, device-bound where
busy is longer than the runner's step). Their sum is the step's period on the device, which,
with steps in flight, is the server's step: the scheduler's loop turns are not (a turn ends
when a result is processed, and results of steps queued behind one another come in pairs).
Nothing is measured off CUDA."""

from __future__ import annotations

import torch


class DeviceClock:
    def __init__(self, device: torch.device) -> None:
        self.on = device.type == "cuda"
        self.last_end: torch.cuda.Event | None = None

    def start(self) -> torch.cuda.Event | None:
        """An event on the current stream, before a step's first op (None off CUDA)."""
        if not self.on:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def step_ms(
        self, start: torch.cuda.Event | None, end: torch.cuda.Event | None
    ) -> dict[str, float]:
        """The step's busy and idle milliseconds, once `end` (its result's event, recorded with
        timing) has completed; steps must come in launch order."""
        if start is None or end is None:
            return {}
        times = {"device_busy": start.elapsed_time(end)}
        if self.last_end is not None:
            times["device_idle"] = max(0.0, self.last_end.elapsed_time(start))
            # The step's period on the device: from the previous step's end to its own.
            times["device_period"] = times["device_busy"] + times["device_idle"]
        self.last_end = end
        return times
