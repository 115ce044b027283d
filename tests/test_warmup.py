"""The warm-up before ready (a dummy step per phase through the general path) and the JIT-miss
log after it: the warm-up changes nothing serving sees, and compiles after ready are counted."""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from graph_emulation import EmulatedCapturer

import srt.model_executor.graphs.full as cuda_graph_runner
import srt.model_executor.graphs.pool as graph_memory
import srt.model_executor.jit_misses as jit_misses
from srt import Engine
from srt.batch_layout import DUMMY_SLOT, ForwardMode
from srt.ipc.reports import JitMiss
from srt.model_executor.jit_misses import (
    MAX_LISTED,
    JitMissLog,
    install_triton_hooks,
    report_miss,
)
from srt.model_executor.warmup import warmup_plans

PROMPTS = [[1, 5, 7, 9, 11], [3, 4, 5, 6, 7, 8, 9], [10, 20, 30]]
PARAMS: list[dict[str, Any]] = [
    {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
    {"max_new_tokens": 6, "temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 7},
    {"max_new_tokens": 6, "temperature": 1.1, "min_p": 0.05, "ignore_eos": True},  # unseeded
]


def make_engine(path: Path, tmp_path: Path, **kwargs: Any) -> Engine:
    return Engine(
        model_path=str(path), device="cpu", compile_cache_dir=str(tmp_path / "cache"), **kwargs
    )


def kv_outside_the_dummy_slot(eng: Engine) -> torch.Tensor:
    cache = eng.runner.kv_cache
    keep = torch.arange(cache.num_slots) != DUMMY_SLOT
    return torch.stack([t[keep] for t in cache.k + cache.v])


def dummy_slot_written(eng: Engine) -> bool:
    return any(bool(t[DUMMY_SLOT].any()) for t in eng.runner.kv_cache.k)


# ---- the warm-up ----------------------------------------------------------------------------


def test_warmup_runs_before_ready_and_leaves_no_trace(
    tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="srt.model_executor.model_runner"):
        eng = make_engine(tiny_llama, tmp_path)
    with eng:
        info = eng.get_server_info()
        assert info["runner"]["warmup_s"] >= 0
        assert sum("warm-up: 3 dummy steps" in r.getMessage() for r in caplog.records) == 1
        assert dummy_slot_written(eng)  # it ran the model, writing KV to the dummy slot only
        assert not kv_outside_the_dummy_slot(eng).any()
        assert not eng.runner.req_to_token.any()  # the table row it used is restored
        sched = info["scheduler"]
        assert sched["kv_slots_free"] == sched["kv_slots_total"] == eng.runner.num_slots - 1


def test_kernels_compile_ahead_on_cuda_only(tiny_llama: Path, tmp_path: Path) -> None:
    """Off CUDA no Triton kernel runs, so none compiles ahead: the info says it did not run."""
    with make_engine(tiny_llama, tmp_path) as eng:
        info = eng.get_server_info()
        assert info["runner"]["compile_ahead"] is None


def test_the_compile_ahead_forwards_run_the_first_layer_only(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """`first_layer_only`, around the compile-ahead block's forwards: inside, a forward runs
    layer 0 alone (every layer's kernels, one time each); after it, every layer again and the
    same logits as before it."""
    with make_engine(tiny_llama, tmp_path, skip_warmup=True) as eng:
        model = eng.runner.model
        calls: list[int] = []
        hooks = [
            layer.register_forward_hook(lambda *_, i=i: calls.append(i))
            for i, layer in enumerate(model.model.layers)
        ]
        plan = warmup_plans(eng.runner.context_length)[0]
        runner = eng.runner.phase_runners[plan.mode]
        with eng.runner._dummy_steps():
            _, before = runner.run_general(plan)
            calls.clear()
            with model.first_layer_only():
                runner.run_general(plan)
            assert calls == [0]
            calls.clear()
            _, after = runner.run_general(plan)
        assert calls == list(range(len(model.model.layers))) and len(calls) > 1
        assert torch.equal(before, after)
        for hook in hooks:
            hook.remove()


def test_skip_warmup_runs_nothing(
    tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="srt.model_executor.model_runner"):
        eng = make_engine(tiny_llama, tmp_path, skip_warmup=True)
    with eng:
        assert eng.get_server_info()["runner"]["warmup_s"] == 0
        assert not any("warm-up" in r.getMessage() for r in caplog.records)
        assert not dummy_slot_written(eng)


def test_ids_are_the_same_with_and_without_warmup(tiny_llama: Path, tmp_path: Path) -> None:
    runs = []
    for skip in (True, False):
        with make_engine(tiny_llama, tmp_path, skip_warmup=skip) as eng:
            results = eng.generate(input_ids=PROMPTS, sampling_params=PARAMS)
            runs.append([r["output_ids"] for r in results])
    assert runs[0] == runs[1]
    assert runs[0][1] != runs[0][0]  # the sampled requests did sample


def test_warmup_captures_nothing_and_marks_no_bucket(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    capturer = EmulatedCapturer()
    monkeypatch.setattr(graph_memory, "default_capturer", lambda device: capturer)
    with make_engine(
        tiny_llama,
        tmp_path,
        cuda_graph_backend_decode="full",
        cuda_graph_backend_prefill="breakable",
        cuda_graph_bs_decode=[1, 2],
        cuda_graph_bs_prefill=[16, 32],
    ) as eng:
        assert dummy_slot_written(eng)
        assert capturer.sessions == capturer.warmups == 0
        graphs = eng.get_server_info()["graphs"]
        for phase in ("decode", "prefill"):
            assert {b["state"] for b in graphs[phase]["buckets"]} == {"unseen"}
            assert graphs[phase]["uncaptured_runs"] == 0
        assert not eng.runner.compile_cache.manifest.buckets


@pytest.mark.parametrize("backend", ["tc_piecewise", "full"])
def test_compiled_phases_warm_up_on_the_general_graph_only(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """tc_piecewise, and full over the compiled general graph: the warm-up runs the general
    graph without moving any bucket, its general_runs count or the manifest."""
    capturer = EmulatedCapturer()
    monkeypatch.setattr(graph_memory, "default_capturer", lambda device: capturer)
    with make_engine(
        tiny_llama,
        tmp_path,
        cuda_graph_backend_decode=backend,
        cuda_graph_backend_prefill=backend,
        cuda_graph_tc_compiler="eager",
        cuda_graph_bs_decode=[1, 2],
        cuda_graph_bs_prefill=[16, 32],
    ) as eng:
        assert dummy_slot_written(eng)
        assert capturer.sessions == capturer.warmups == 0
        graphs = eng.get_server_info()["graphs"]
        for phase in ("decode", "prefill"):
            assert {b["state"] for b in graphs[phase]["buckets"]} == {"unseen"}
            assert graphs[phase]["forward"]["general_runs"] == graphs[phase]["uncaptured_runs"] == 0
        assert not eng.runner.compile_cache.manifest.buckets


@pytest.mark.parametrize("context_length", [1, 2, 5, 4096])
def test_warmup_plans_fit_the_context(context_length: int) -> None:
    fresh, prefill, decode = warmup_plans(context_length)
    modes = (fresh.forward_mode, prefill.forward_mode, decode.forward_mode)
    assert modes == (ForwardMode.EXTEND, ForwardMode.EXTEND, ForwardMode.DECODE)
    assert fresh.prefix_lens.tolist() == [0]  # a prompt from scratch
    for plan in (fresh, prefill, decode):
        seq = int(plan.prefix_lens[0] + plan.extend_lens[0])
        assert seq <= context_length
        assert plan.positions.tolist() == list(range(int(plan.prefix_lens[0]), seq))
        assert set(plan.out_cache_loc.tolist()) == set(plan.table_slots.tolist()) == {DUMMY_SLOT}
        assert plan.table_cols.tolist() == list(range(seq))
    assert decode.extend_lens.tolist() == [1]
    if context_length >= 4:
        assert prefill.prefix_lens[0] > 0  # the extend kernel runs over a cached prefix


# ---- JIT misses after ready -----------------------------------------------------------------


def test_a_compile_after_ready_is_a_miss() -> None:
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    log = JitMissLog()
    before = torch.compile(double, backend="eager")
    before(torch.ones(3))  # before ready: not a miss
    log.arm()
    assert log.count == 0
    log.step = (ForwardMode.DECODE, 3, 3)
    after = torch.compile(lambda x: double(x) - 1, backend="eager")
    after(torch.ones(4))
    after(torch.ones(4))  # compiled already: no second miss
    assert log.count == 1
    (miss,) = log.info().listed
    assert miss.what.startswith("torch.compile")
    assert miss.ms > 0
    assert miss.during == "decode step of 3 request(s), 3 token(s)"


def test_arming_after_a_dynamo_reset_hooks_again() -> None:
    # torch._dynamo.reset() drops every compile callback, ours too.
    JitMissLog().arm()
    torch._dynamo.reset()
    log = JitMissLog()
    log.arm()
    torch.compile(lambda x: x * 3, backend="eager")(torch.ones(2))
    assert log.count == 1


def test_the_miss_list_is_bounded_and_the_count_is_not() -> None:
    log = JitMissLog()
    log.arm()
    for i in range(MAX_LISTED + 5):
        report_miss(f"kernel {i}", 1.0)
    info = log.info()
    assert info.count == MAX_LISTED + 5
    assert len(info.listed) == MAX_LISTED
    assert info.listed[0] == JitMiss("kernel 0", 1.0, None)


def test_a_disarmed_log_counts_no_more_and_sums_the_milliseconds() -> None:
    """The warm-up's log of what compiled at a launch after the compile ahead is armed for the
    warm-up alone."""
    log = JitMissLog("in the warm-up, not compiled ahead")
    log.arm()
    report_miss("triton _chunk_argmax_kernel", 250.0)
    report_miss("triton _row_argmax_kernel", 120.5)
    log.disarm()
    report_miss("triton after the warm-up", 9.0)
    assert (log.count, log.ms) == (2, 370.5)


def test_triton_hooks_time_each_compile_and_chain() -> None:
    """Triton's JIT calls `jit_cache_hook` before a compile (a true return skips it) and
    `jit_post_compile_hook` after, with keyword arguments; `repr` names the specialisation."""
    seen: list[str] = []
    runtime = SimpleNamespace(
        jit_cache_hook=lambda **kw: seen.append("start") or False,
        jit_post_compile_hook=lambda **kw: seen.append("end"),
    )
    misses: list[tuple[str, float]] = []
    install_triton_hooks(runtime, lambda what, ms: misses.append((what, ms)))
    hook_args = {"key": "k", "fn": None, "compile": {}, "is_manual_warmup": False}
    name = "_decode_kernel[num_warps=4](Q: *bf16)"
    assert not runtime.jit_cache_hook(repr=name, already_compiled=False, **hook_args)
    runtime.jit_post_compile_hook(repr=name, already_compiled=False, **hook_args)
    assert seen == ["start", "end"]
    ((what, ms),) = misses
    assert what == f"triton {name}" and ms >= 0
    runtime.jit_post_compile_hook(repr="never started", already_compiled=False, **hook_args)
    assert len(misses) == 1


def test_flashinfer_builds_are_summed_and_a_compile_after_ready_is_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every FlashInfer module goes through `flashinfer.jit.JitSpec.build_and_load`, which
    runs ninja (nvcc for a module its cache lacks) and loads the library: one that the call
    wrote was compiled, one it did not was only loaded."""

    class JitSpec:  # what the hook reads of flashinfer.jit.JitSpec
        def __init__(self, name: str) -> None:
            self.name = name
            self.jit_library_path = tmp_path / name / f"{name}.so"

        def build_and_load(self) -> str:
            if not self.jit_library_path.exists():  # ninja builds only what is missing
                self.jit_library_path.parent.mkdir()
                self.jit_library_path.write_bytes(b"\x7fELF")
            return f"module {self.name}"

    fake = SimpleNamespace(__version__="0.5.3", jit=SimpleNamespace(JitSpec=JitSpec))
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(jit_misses, "_flashinfer_hooked", False)
    before = dataclasses.replace(jit_misses.flashinfer_builds)
    jit_misses.install_hooks()  # as the runner does before its warm-up
    assert JitSpec("decode").build_and_load() == "module decode"  # compiled, before ready
    log = JitMissLog()
    log.arm()
    JitSpec("decode").build_and_load()  # in the cache: loaded, no miss
    assert log.count == 0
    JitSpec("prefill").build_and_load()  # compiled after ready
    assert [m.what for m in log.info().listed] == ["flashinfer prefill"]
    built = jit_misses.flashinfer_builds.since(before)
    assert (built.compiled, built.loaded) == (2, 1) and built.s >= 0


def test_engine_info_has_the_miss_log(tiny_llama: Path, tmp_path: Path) -> None:
    with make_engine(tiny_llama, tmp_path) as eng:
        eng.generate(input_ids=PROMPTS[0], sampling_params=PARAMS[0])
        misses = eng.get_server_info()["runner"]["jit_misses"]
        assert misses == {"count": 0, "listed": []}  # the CPU eager path compiles nothing
        flashinfer = eng.get_server_info()["runner"]["flashinfer_jit"]
        assert flashinfer == {"compiled": 0, "loaded": 0, "s": 0.0}  # another backend


@pytest.fixture
def dynamo_reset_after() -> Iterator[None]:
    """Dynamo state is per code object: what a test compiled (or, having run compiled code
    under the emulated capture's dispatch mode, left to run eagerly) must not reach the next."""
    yield
    torch._dynamo.reset()


def test_enable_torch_compile_first_bucket_hit_is_a_miss(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dynamo_reset_after: None
) -> None:
    """`--enable-torch-compile` compiles a `full` bucket on its first hit: after ready, so it
    is a miss, named with the step it happened in; later hits compile nothing. (Dynamo with the
    eager backend stands in for Inductor, to keep the test fast; the callbacks are the same.)"""
    capturer = EmulatedCapturer()
    monkeypatch.setattr(graph_memory, "default_capturer", lambda device: capturer)
    eager_compile = functools.partial(torch.compile, backend="eager")
    monkeypatch.setattr(cuda_graph_runner.torch, "compile", eager_compile)
    with make_engine(
        tiny_llama,
        tmp_path,
        cuda_graph_backend_decode="full",
        cuda_graph_bs_decode=[4],
        enable_torch_compile=True,
    ) as eng:
        assert eng.get_server_info()["runner"]["jit_misses"]["count"] == 0
        # Decode batches of 3, 2 and 1 requests, all in bucket 4.
        lengths = [{**PARAMS[0], "max_new_tokens": n} for n in (3, 5, 8)]
        eng.generate(input_ids=PROMPTS, sampling_params=lengths)
        info = eng.get_server_info()
    assert info["graphs"]["decode"]["buckets"][0]["replays"] == 7
    misses = info["runner"]["jit_misses"]
    assert misses["count"] == 1, misses
    (miss,) = misses["listed"]
    assert miss["what"].startswith("torch.compile") and miss["ms"] > 0
    assert miss["during"] == "decode step of 3 request(s), 3 token(s)"
