"""The per-step timeline: gaps between marks, the period between steps, a bounded ring."""

from __future__ import annotations

import time

import pytest

from srt.timeline import StepTimeline


def test_gaps_period_and_ring() -> None:
    timeline = StepTimeline(("start", "sent", "done"), size=4)
    empty = timeline.summary()
    assert empty.steps == 0 and empty.window_steps == 0 and empty.cpu_s >= 0
    assert empty.gaps_ms == {} and empty.period_ms is None and empty.kinds == {}
    for _ in range(6):
        timeline.begin()
        time.sleep(0.002)
        timeline.mark("sent")
        timeline.mark("done")
    timeline.begin()
    timeline.discard()  # a turn that did nothing is not counted
    summary = timeline.summary()
    # The ring keeps 4 rows; the discarded turn took the oldest one's.
    assert summary.steps == 6 and summary.window_steps == 3
    assert summary.gaps_ms["start_to_sent"] >= 2.0  # the sleep is inside this gap
    assert summary.gaps_ms["sent_to_done"] >= 0
    assert summary.period_ms is not None and summary.period_ms >= 2.0  # each holds a sleep


def test_marks_by_step_number_and_missing_gaps() -> None:
    timeline = StepTimeline(("received", "launched", "result_sent"), size=8)
    timeline.begin(1)
    timeline.mark("launched")
    timeline.begin(2)
    timeline.mark("launched")
    timeline.mark("result_sent", 1)  # step 1's result goes out once step 2 is launched
    summary = timeline.summary()
    assert set(summary.gaps_ms) == {"received_to_launched", "launched_to_result_sent"}
    assert summary.period_ms is not None
    timeline.mark("result_sent", -20)  # fell out of the ring: ignored
    only_start = StepTimeline(("a", "b"))
    only_start.begin()
    assert only_start.summary().gaps_ms == {} and only_start.summary().period_ms is None


def test_a_window_from_a_moment_on() -> None:
    # The steps of one benchmark run: those begun from a clock value on (the same
    # perf_counter clock in every process of the host).
    timeline = StepTimeline(("start", "done"), size=16)
    for _ in range(3):
        timeline.begin()
        time.sleep(0.004)
        timeline.mark("done")
    since = time.perf_counter()
    for _ in range(2):
        timeline.begin()
        timeline.mark("done")
    window = timeline.summary(since)
    assert window.steps == 5 and window.window_steps == 2
    assert window.gaps_ms["start_to_done"] < 4.0  # none of the slow steps before `since`
    assert timeline.summary().gaps_ms["start_to_done"] >= 4.0  # the median of all five
    nothing = timeline.summary(time.perf_counter())
    assert nothing.window_steps == 0 and nothing.period_ms is None


def test_steps_by_kind_count_their_long_steps_in_full() -> None:
    """A median hides the rare long step; the per-kind totals do not."""
    timeline = StepTimeline(("start", "done"), size=16)
    for kind, requests, tokens, sleep_s in [
        ("extend", 2, 256, 0.03),
        ("decode", 2, 2, 0.0),
        ("decode", 3, 3, 0.0),
        ("extend", 1, 128, 0.03),
        ("decode", 3, 3, 0.0),
    ]:
        timeline.begin()
        timeline.tag(kind, requests, tokens)
        time.sleep(sleep_s)
        timeline.mark("done")
    timeline.begin()  # the last step's period ends where the next one begins
    cpu_before = timeline.summary().cpu_s
    sum(i * i for i in range(300_000))  # some CPU work shows in the process's CPU seconds
    summary = timeline.summary()
    extend, decode = summary.kinds["extend"], summary.kinds["decode"]
    assert extend.steps == 2 and decode.steps == 3
    assert extend.requests_mean == 1.5 and extend.tokens_mean == 192
    assert decode.requests_mean == round(8 / 3, 2)
    assert extend.ms_total >= 60.0  # both long steps, in full
    assert decode.ms_total < extend.ms_total
    # Each kind's own median gaps: the prefills' 30 ms path apart from the decodes'.
    assert extend.gaps_ms["start_to_done"] >= 30.0 > decode.gaps_ms["start_to_done"]
    assert summary.period_ms is not None and summary.period_ms < 30.0  # short periods only
    # Each kind's spread of periods: the prefills' all long, the decodes' all short.
    assert set(extend.periods_ms) == {"p10", "p50", "p90"}
    assert 30.0 <= extend.periods_ms["p10"] <= extend.periods_ms["p50"] <= extend.periods_ms["p90"]
    assert decode.periods_ms["p10"] <= decode.periods_ms["p50"] <= decode.periods_ms["p90"] < 30.0
    assert summary.cpu_s > cpu_before


def test_durations_are_averaged_over_the_window_and_per_kind() -> None:
    """A step's measured durations (the runner's device busy and idle ms): means, not medians,
    so that a device idle on one step in four shows; a step that fell out of the ring, or
    before the window, counts for nothing."""
    timeline = StepTimeline(("start", "done"), size=8, durations=("busy", "idle"))
    for step, (kind, busy, idle) in enumerate(
        [("decode", 1.0, 0.0), ("decode", 1.0, 0.0), ("extend", 3.0, 2.0), ("decode", 2.0, 0.8)],
        start=1,
    ):
        timeline.begin(step)
        timeline.tag(kind, 1, 1)
        timeline.mark("done")
        timeline.record("busy", step, busy)
        if step > 1:  # the first step has no step before it to be idle after
            timeline.record("idle", step, idle)
    timeline.record("busy", -20, 99.0)  # fell out of the ring: ignored
    timeline.begin(5)
    summary = timeline.summary()
    assert summary.means_ms == {"busy": 1.75, "idle": round(2.8 / 3, 4)}
    assert summary.kinds["decode"].means_ms == {"busy": round(4 / 3, 4), "idle": 0.4}
    assert summary.kinds["extend"].means_ms == {"busy": 3.0, "idle": 2.0}
    assert summary.kinds["decode"].medians_ms == {"busy": 1.0, "idle": 0.4}
    assert timeline.summary(time.perf_counter()).means_ms == {}
    plain = StepTimeline(("start", "done"))
    plain.begin()
    assert plain.summary().means_ms == {}


def test_device_clock_measures_nothing_off_cuda() -> None:
    torch = pytest.importorskip("torch")
    from srt.model_executor.device_clock import DeviceClock

    clock = DeviceClock(torch.device("cpu"))
    assert clock.start() is None and clock.step_ms(None, None) == {}


@pytest.mark.gpu
def test_device_clock_splits_a_step_into_busy_and_idle() -> None:
    """Two steps of device work with the host asleep between them: the second's idle holds
    the sleep, each one's busy the work (the runner's events, as `RunnerLoop` records them)."""
    import torch

    from srt.model_executor.device_clock import DeviceClock

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    clock = DeviceClock(torch.device("cuda"))
    x = torch.randn(4096, 4096, device="cuda")
    steps = []
    for _ in range(2):
        start = clock.start()
        for _ in range(20):
            x = x @ x / 64
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        steps.append(clock.step_ms(start, end))
        time.sleep(0.05)
    assert set(steps[0]) == {"device_busy"} and steps[0]["device_busy"] > 0.1
    assert steps[1]["device_busy"] > 0.1 and steps[1]["device_idle"] >= 45.0
    assert steps[1]["device_period"] == steps[1]["device_busy"] + steps[1]["device_idle"]
