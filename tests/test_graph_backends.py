"""Graph backends on the CPU: per-phase config precedence and validation, bucket ladders, padding
into static buffers, and the lazy per-bucket state machine of `full`, `breakable` and the
tc_piecewise piece capture, with CUDA graph capture replaced by the CPU emulation in
`graph_emulation` (it replays recorded ops on the captured tensors, so a runner that forgets to
refill a static buffer, or bakes a host value into a graph, gives different ids)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from graph_emulation import EmulatedCapturer

import srt.model_executor.graphs.pool as graph_memory
from srt import Engine
from srt.batch_layout import ForwardMode
from srt.compilation.dispatch import BucketDispatcher
from srt.ipc.messages import BatchPlan
from srt.model_executor.graphs.config import (
    Backend,
    GraphConfigError,
    Phase,
    default_decode_ladder,
    default_prefill_ladder,
    resolve_graph_config,
)
from srt.model_executor.graphs.piecewise import PieceGraphs
from srt.model_executor.graphs.pool import GraphPool
from srt.model_executor.graphs.static_batch import StaticBatch, dummy_plan
from srt.model_executor.step_inputs import upload_step
from srt.server_args import ServerArgs

# Three requests that finish after 3, 5 and 8 tokens: decode batches of 3, 2 and 1 requests
# (3 is padded to bucket 4), and one prefill of 5 + 7 + 3 = 15 tokens (padded to 16).
PROMPTS = [[1, 5, 7, 9, 11], [3, 4, 5, 6, 7, 8, 9], [10, 20, 30]]
PARAMS = [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in (5, 3, 8)]
SMALL_LADDERS = {"cuda_graph_bs_decode": [1, 2, 4], "cuda_graph_bs_prefill": [8, 16]}


def resolve(device: str = "cpu", **kwargs: Any) -> dict[Phase, Any]:
    return resolve_graph_config(ServerArgs(**kwargs), device)


# ---- configuration ------------------------------------------------------------------------


def test_defaults_depend_on_the_device_and_the_attention_backend() -> None:
    cpu, cuda = resolve("cpu"), resolve("cuda")
    assert cpu[Phase.DECODE].backend is Backend.DISABLED
    assert cpu[Phase.PREFILL].backend is Backend.DISABLED
    # triton runs both phases inside a graph: both are captured.
    assert cuda[Phase.DECODE].backend is Backend.FULL
    assert cuda[Phase.PREFILL].backend is Backend.FULL
    # A backend that captures decode only (flashinfer), and one that captures nothing.
    decode_only = resolve_graph_config(ServerArgs(), "cuda", frozenset({ForwardMode.DECODE}))
    assert decode_only[Phase.DECODE].backend is Backend.FULL
    assert decode_only[Phase.PREFILL].backend is Backend.DISABLED
    neither = resolve_graph_config(ServerArgs(), "cuda", frozenset())
    assert neither[Phase.DECODE].backend is Backend.BREAKABLE
    assert neither[Phase.PREFILL].backend is Backend.DISABLED


def test_flags_win_over_defaults_and_json_over_flags() -> None:
    by_flags = resolve("cuda", cuda_graph_backend_decode="breakable", cuda_graph_bs_decode=[1, 3])
    assert by_flags[Phase.DECODE].backend is Backend.BREAKABLE
    assert by_flags[Phase.DECODE].bs == [1, 3]
    both = resolve(
        "cuda",
        cuda_graph_backend_decode="breakable",
        cuda_graph_bs_decode=[1, 3],
        cuda_graph_config=json.dumps(
            {"decode": {"backend": "tc_piecewise", "bs": [2, 4]}, "prefill": {"max_bs": 64}}
        ),
    )
    decode, prefill = both[Phase.DECODE], both[Phase.PREFILL]
    assert (decode.backend, decode.bs) == (Backend.TC_PIECEWISE, [2, 4])
    assert decode.tc_compiler == "eager"
    assert prefill.backend is Backend.FULL and prefill.bs[-1] == 64


def test_disable_cuda_graph_turns_every_phase_off() -> None:
    configs = resolve("cuda", disable_cuda_graph=True, cuda_graph_backend_prefill="full")
    assert {c.backend for c in configs.values()} == {Backend.DISABLED}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"cuda_graph_backend_decode": "fast"},
            "--cuda-graph-backend-decode: unknown backend 'fast'",
        ),
        (
            {"cuda_graph_config": '{"prefill": {"backend": "fast"}}'},
            "--cuda-graph-config prefill.backend: unknown backend 'fast'",
        ),
        ({"cuda_graph_bs_prefill": []}, "--cuda-graph-bs-prefill: the bucket list is empty"),
        (
            {"cuda_graph_bs_decode": [1, 4, 4]},
            "--cuda-graph-bs-decode: buckets must be strictly increasing",
        ),
        (
            {"cuda_graph_config": '{"decode": {"bs": [8, 2]}}'},
            "--cuda-graph-config decode.bs: buckets must be strictly increasing",
        ),
        ({"cuda_graph_bs_decode": [0, 2]}, "--cuda-graph-bs-decode: buckets must be positive"),
        (
            {
                "cuda_graph_config": '{"decode": {"backend": "full", "tc_compiler": "inductor"}}',
                "enable_torch_compile": True,
            },
            "--cuda-graph-config decode.tc_compiler: a full phase with a tc compiler captures",
        ),
        (
            {"cuda_graph_backend_prefill": "tc_piecewise", "cuda_graph_tc_compiler": "gcc"},
            "--cuda-graph-tc-compiler: unknown compiler 'gcc'",
        ),
        ({"cuda_graph_config": "{"}, "--cuda-graph-config: invalid JSON"),
        ({"cuda_graph_config": '{"middle": {}}'}, "--cuda-graph-config: expected an object"),
        ({"cuda_graph_config": '{"decode": {"bss": [1]}}'}, "--cuda-graph-config: unknown key"),
        ({"cuda_graph_max_bs_decode": 0}, "--cuda-graph-max-bs-decode: must be a positive integer"),
        (
            {"cuda_graph_bs_decode": [4, 8], "cuda_graph_max_bs_decode": 2},
            "--cuda-graph-max-bs-decode: 2 is below the smallest bucket",
        ),
    ],
)
def test_invalid_settings_name_the_flag(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(GraphConfigError) as err:
        resolve("cuda", **kwargs)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("compiler", ["inductor", "gcc"])
def test_a_tc_compiler_no_phase_uses_is_a_warning(
    compiler: str, caplog: pytest.LogCaptureFixture
) -> None:
    # As SGLang does: ignored, not refused (whatever its value, since nothing compiles).
    with caplog.at_level(logging.WARNING, logger="srt.model_executor.graphs.config"):
        configs = resolve(
            "cuda",
            cuda_graph_tc_compiler=compiler,
            cuda_graph_backend_decode="breakable",
            cuda_graph_backend_prefill="disabled",
        )
    assert all(c.tc_compiler is None for c in configs.values())
    message = f"--cuda-graph-tc-compiler {compiler} is ignored: no phase uses tc_piecewise or full"
    assert message in caplog.text


def test_the_tc_compiler_flag_applies_to_full_phases_too() -> None:
    """Compile once, capture per bucket: a full phase with a compiler captures the compiled
    general graph, unless --enable-torch-compile keeps SGLang's per-bucket compile."""
    configs = resolve("cuda", cuda_graph_tc_compiler="inductor")
    assert configs[Phase.DECODE].backend is Backend.FULL
    assert configs[Phase.DECODE].tc_compiler == "inductor"
    assert configs[Phase.PREFILL].tc_compiler == "inductor"  # full by default on CUDA
    eager_prefill = resolve(
        "cuda", cuda_graph_tc_compiler="inductor", cuda_graph_backend_prefill="disabled"
    )
    assert eager_prefill[Phase.PREFILL].tc_compiler is None  # disabled: the eager forward
    per_bucket = resolve("cuda", cuda_graph_tc_compiler="inductor", enable_torch_compile=True)
    assert per_bucket[Phase.DECODE].tc_compiler is None
    both = resolve(
        "cuda", cuda_graph_tc_compiler="eager", cuda_graph_backend_prefill="tc_piecewise"
    )
    assert [c.tc_compiler for c in both.values()] == ["eager", "eager"]


def test_engine_rejects_a_bad_flag(tiny_llama: Path) -> None:
    with pytest.raises(GraphConfigError, match="--cuda-graph-backend-prefill"):
        Engine(model_path=str(tiny_llama), device="cpu", cuda_graph_backend_prefill="everything")


def test_default_ladders_match_the_design() -> None:
    assert default_decode_ladder() == [1, 2, 4, 8, 12, *range(16, 257, 8)]
    assert default_prefill_ladder() == [
        4,
        8,
        12,
        16,
        20,
        24,
        28,
        32,
        *range(48, 257, 16),
        *range(288, 513, 32),
        *range(576, 1025, 64),
        *range(1280, 4097, 256),
    ]
    assert default_decode_ladder()[-3:] == [240, 248, 256]
    assert default_prefill_ladder()[-2:] == [3840, 4096]


def test_ladders_are_clamped_to_max_bs() -> None:
    configs = resolve(cuda_graph_max_bs_decode=20, cuda_graph_max_bs_prefill=300)
    assert configs[Phase.DECODE].bs == [1, 2, 4, 8, 12, 16]
    assert configs[Phase.PREFILL].bs[-2:] == [256, 288]
    explicit = resolve(cuda_graph_bs_decode=[2, 6, 10], cuda_graph_max_bs_decode=6)
    assert explicit[Phase.DECODE].bs == [2, 6] and explicit[Phase.DECODE].max_bs == 6
    decode = configs[Phase.DECODE]
    assert [decode.bucket_for(n) for n in (1, 3, 12, 13, 16, 17)] == [1, 4, 12, 16, 16, None]


# ---- padding into static buffers ---------------------------------------------------------


TABLE = torch.zeros(8, 64, dtype=torch.int32)


def live_plan(mode: ForwardMode, extend: list[int], prefix: list[int]) -> BatchPlan:
    n = sum(extend)
    return BatchPlan.greedy(
        mode,
        input_ids=np.arange(100, 100 + n),
        positions=np.arange(n) + 1,
        out_cache_loc=np.arange(50, 50 + n),
        req_pool_indices=np.arange(3, 3 + len(extend)),
        prefix_lens=np.array(prefix),
        extend_lens=np.array(extend),
    )


def test_decode_padding() -> None:
    static = StaticBatch(max_tokens=8, max_requests=8, device=torch.device("cpu"))
    padded = static.load(live_plan(ForwardMode.DECODE, [1, 1, 1], [4, 6, 9]), 4, 4, TABLE, None)
    assert padded.input_ids.tolist() == [100, 101, 102, 0]
    assert padded.positions.tolist() == [1, 2, 3, 0]
    assert padded.out_cache_loc.tolist() == [50, 51, 52, 0]  # the dummy slot
    assert padded.req_pool_indices.tolist() == [3, 4, 5, 0]
    assert padded.seq_lens.tolist() == [5, 7, 10, 1]
    assert padded.prefix_lens.tolist() == [4, 6, 9, 0]
    assert padded.extend_lens.tolist() == [1, 1, 1, 1]
    assert padded.extend_start_loc.tolist() == [0, 1, 2, 3]
    assert (padded.batch_size, padded.num_tokens) == (3, 3)
    assert padded.seq_lens_cpu.tolist() == [5, 7, 10]
    assert padded.input_ids.data_ptr() == static.buffer.data_ptr()  # views of the static buffer
    # A smaller batch in the same bucket overwrites the previous batch's tail.
    again = static.load(live_plan(ForwardMode.DECODE, [1], [2]), 4, 4, TABLE, None)
    assert again.input_ids.tolist() == [100, 0, 0, 0]
    assert again.seq_lens.tolist() == [3, 1, 1, 1]
    assert again.extend_start_loc.tolist() == [0, 1, 2, 3]


def test_prefill_padding() -> None:
    static = StaticBatch(max_tokens=16, max_requests=4, device=torch.device("cpu"))
    padded = static.load(live_plan(ForwardMode.EXTEND, [3, 2], [0, 4]), 8, 4, TABLE, None)
    assert padded.input_ids.tolist() == [100, 101, 102, 103, 104, 0, 0, 0]
    assert padded.out_cache_loc.tolist()[5:] == [0, 0, 0]
    assert padded.seq_lens.tolist() == [3, 6, 0, 0]  # padded requests are empty
    assert padded.extend_lens.tolist() == [3, 2, 0, 0]
    assert padded.extend_start_loc.tolist() == [0, 3, 5, 5]
    with pytest.raises(ValueError, match="does not fit"):
        static.load(live_plan(ForwardMode.EXTEND, [6, 6], [0, 0]), 8, 4, TABLE, None)


def test_dummy_batches_fit_the_table() -> None:
    table = torch.zeros(4, 10, dtype=torch.int32)
    decode = upload_step(dummy_plan(ForwardMode.DECODE, 4, 10), table)
    assert decode.extend_lens_cpu.tolist() == [1, 1, 1, 1]
    assert decode.out_cache_loc.tolist() == [0] * 4
    prefill = upload_step(dummy_plan(ForwardMode.EXTEND, 24, 10), table)
    assert prefill.extend_lens_cpu.tolist() == [10, 10, 4]
    assert prefill.positions.tolist() == [*range(10), *range(10), *range(4)]
    assert prefill.extend_start_loc.tolist() == [0, 10, 20]


# ---- the runners, through the Engine, with emulated capture --------------------------------


@pytest.fixture
def capturer(monkeypatch: pytest.MonkeyPatch) -> EmulatedCapturer:
    emulated = EmulatedCapturer()
    monkeypatch.setattr(graph_memory, "default_capturer", lambda device: emulated)
    return emulated


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[list[int]]:
    with Engine(model_path=str(tiny_llama), device="cpu") as eng:
        return [r["output_ids"] for r in eng.generate(input_ids=PROMPTS, sampling_params=PARAMS)]


def make_engine(path: Path, tmp_path: Path, **kwargs: Any) -> Engine:
    return Engine(
        model_path=str(path),
        device="cpu",
        compile_cache_dir=str(tmp_path / "cache"),
        **SMALL_LADDERS,
        **kwargs,
    )


def generate(eng: Engine) -> list[list[int]]:
    return [r["output_ids"] for r in eng.generate(input_ids=PROMPTS, sampling_params=PARAMS)]


def phase_info(eng: Engine, phase: str) -> dict[str, Any]:
    return eng.get_server_info()["graphs"][phase]


def states(eng: Engine, phase: str) -> dict[int, tuple[str, int]]:
    return {b["bucket"]: (b["state"], b["replays"]) for b in phase_info(eng, phase)["buckets"]}


@pytest.mark.parametrize(
    ("decode", "prefill"),
    [
        ("full", "full"),
        ("breakable", "breakable"),
        ("full", "breakable"),
        ("breakable", "full"),
    ],
)
def test_padded_graphs_give_the_eager_ids(
    tiny_llama: Path,
    tmp_path: Path,
    capturer: EmulatedCapturer,
    reference: list[list[int]],
    decode: str,
    prefill: str,
) -> None:
    with make_engine(
        tiny_llama, tmp_path, cuda_graph_backend_decode=decode, cuda_graph_backend_prefill=prefill
    ) as eng:
        assert generate(eng) == reference
        # Decode: 3 requests (padded to 4) for 2 steps, 2 for 2 steps, 1 for 3 steps.
        assert states(eng, "decode") == {4: ("captured", 2), 2: ("captured", 2), 1: ("captured", 3)}
        assert states(eng, "prefill") == {8: ("unseen", 0), 16: ("captured", 1)}
        assert capturer.sessions == 4  # each bucket captured exactly once
        assert capturer.warmups == 4
        info = eng.get_server_info()
        assert info["graphs"] == info["runner"]["graphs"]
        assert info["graphs"]["decode"]["captured"] == [1, 2, 4]
        # A second round replays (the prefix cache shortens the prefill to 3 tokens: bucket 8).
        assert generate(eng) == reference
        assert capturer.sessions == 5
        assert states(eng, "decode") == {4: ("captured", 4), 2: ("captured", 4), 1: ("captured", 6)}


@pytest.mark.parametrize("capture", ["disabled", "full", "breakable", "tc_piecewise"])
@pytest.mark.parametrize("compiler", [None, "eager"])
def test_every_capture_kind_over_every_forward_gives_the_eager_ids(
    tiny_llama: Path,
    tmp_path: Path,
    capturer: EmulatedCapturer,
    reference: list[list[int]],
    capture: str,
    compiler: str | None,
) -> None:
    """How a phase is compiled and how it is captured are two independent choices: each
    capture kind records the eager forward or the compiled general graph alike."""
    if capture == "tc_piecewise" and compiler is None:
        pytest.skip("tc_piecewise always runs the compiled general graph")
    phase = {"backend": capture, **({"tc_compiler": compiler} if compiler else {})}
    with make_engine(
        tiny_llama, tmp_path, cuda_graph_config=json.dumps({"decode": phase, "prefill": phase})
    ) as eng:
        assert generate(eng) == reference
        assert generate(eng) == reference
        decode = phase_info(eng, "decode")
        assert decode["forward"]["tc_compiler"] == compiler
        if capture != "disabled":
            assert decode["captured"] == [1, 2, 4] and capturer.sessions > 0
        if compiler is not None:
            assert eng.get_server_info()["runner"]["compile"]["traces"] == 1


def test_a_full_graph_takes_the_greedy_argmax_along(
    tiny_llama: Path,
    tmp_path: Path,
    capturer: EmulatedCapturer,
    reference: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A greedy decode step replayed from a `full` graph samples nothing of its own: the
    graph computed the argmax beside the logits, and those are the ids. Only the eager steps
    (prefill here) run the sampler."""
    from srt.model_executor import sampling

    calls: list[torch.Tensor | None] = []

    def sample(logits: torch.Tensor, batch: Any, greedy: torch.Tensor | None = None) -> Any:
        calls.append(greedy)
        return real_sample(logits, batch, greedy)

    real_sample = sampling.sample
    monkeypatch.setattr(sampling, "sample", sample)
    with make_engine(
        tiny_llama, tmp_path, cuda_graph_backend_decode="full", skip_warmup=True
    ) as eng:
        assert generate(eng) == reference
        decode = phase_info(eng, "decode")
        steps = eng.get_server_info()["scheduler"]
    assert decode["replays"] == steps["decode_steps"] > 0
    assert len(calls) == steps["prefill_steps"] and all(g is None for g in calls)


@pytest.mark.parametrize("seeded", [True, False])
def test_a_full_graph_samples_in_a_graph_of_its_bucket(
    tiny_llama: Path,
    tmp_path: Path,
    capturer: EmulatedCapturer,
    seeded: bool,
) -> None:
    """Top-k/top-p/min-p sampling of a replayed step runs in the bucket's sampler graph,
    captured once per bucket: the same ids as the uncaptured sampler, mixed greedy rows too."""
    params = [
        {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
        {"max_new_tokens": 6, "temperature": 0.9, "top_k": 20, "top_p": 0.8, "ignore_eos": True},
        {"max_new_tokens": 6, "temperature": 1.3, "min_p": 0.05, "ignore_eos": True},
    ]
    if seeded:
        params = [{**p, "seed": 11 + i} for i, p in enumerate(params)]

    def run(**graphs: Any) -> tuple[list[list[int]], dict[str, Any]]:
        with make_engine(tiny_llama, tmp_path / str(len(graphs)), **graphs) as eng:
            out = [r["output_ids"] for r in eng.generate(input_ids=PROMPTS, sampling_params=params)]
            return out, phase_info(eng, "decode")

    eager, _ = run(cuda_graph_backend_decode="disabled")
    sessions = capturer.sessions
    graphed, decode = run(cuda_graph_backend_decode="full")
    if seeded:  # a seed fixes the draws: the graph must reproduce them
        assert graphed == eager
    assert [len(o) for o in graphed] == [6, 6, 6]
    # The three decode together (bucket 4) for 5 steps: one forward graph, one sampler graph.
    assert decode["captured"] == decode["capture"]["samplers_captured"] == [4]
    assert capturer.sessions - sessions == 2 and decode["replays"] == 5


def test_the_greedy_argmax_runs_in_the_warm_up_before_its_capture(
    tiny_llama: Path,
    tmp_path: Path,
    capturer: EmulatedCapturer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """So that its kernel's first call (a JIT compile on CUDA) is never inside a capture,
    even with --skip-warmup."""
    from srt.model_executor.graphs import full

    calls: list[tuple[int, int]] = []  # (warm-ups, captures) begun at each call

    def greedy_ids(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        calls.append((capturer.warmups, capturer.sessions))
        return real(logits, out)

    real = full.greedy_ids
    monkeypatch.setattr(full, "greedy_ids", greedy_ids)
    with make_engine(
        tiny_llama, tmp_path, cuda_graph_backend_decode="full", skip_warmup=True
    ) as eng:
        generate(eng)
        captures = eng.get_server_info()["runner"]["graph_pool"]["captures"]
    # The pool warms a bucket up (twice) before it captures it: each capture's call comes
    # right after a call of its warm-up, made before that capture began.
    assert captures > 0 and calls[0][1] == 0
    for capture in range(1, captures + 1):
        first_inside = next(i for i, (_, began) in enumerate(calls) if began == capture)
        assert calls[first_inside - 1][1] == capture - 1, calls


def test_breakable_splits_at_every_attention(
    tiny_llama: Path,
    tmp_path: Path,
    capturer: EmulatedCapturer,
    reference: list[list[int]],
) -> None:
    with make_engine(tiny_llama, tmp_path, cuda_graph_backend_decode="breakable") as eng:
        layers = eng.model_config.num_layers
        assert generate(eng) == reference
    # One segment before each attention call and one after the last: layers + 1 per capture.
    assert len(capturer.graphs) == capturer.sessions * (layers + 1) == 3 * (layers + 1)


def test_lazy_capture_state_machine(
    tiny_llama: Path,
    tmp_path: Path,
    capturer: EmulatedCapturer,
) -> None:
    with make_engine(
        tiny_llama,
        tmp_path,
        cuda_graph_backend_decode="full",
        cuda_graph_backend_prefill="full",
        enable_prefix_caching=False,
    ) as eng:
        assert states(eng, "decode") == {1: ("unseen", 0), 2: ("unseen", 0), 4: ("unseen", 0)}
        one = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
        eng.generate(input_ids=PROMPTS[0], sampling_params=one)  # first hits: capture
        assert capturer.sessions == 2
        assert states(eng, "prefill") == {8: ("captured", 1), 16: ("unseen", 0)}
        assert states(eng, "decode")[1] == ("captured", 2)
        eng.generate(input_ids=PROMPTS[1], sampling_params=one)  # later hits: replay
        assert capturer.sessions == 2
        assert states(eng, "prefill")[8] == ("captured", 2)
        assert states(eng, "decode")[1] == ("captured", 4)
        # Beyond the largest bucket: the general (eager) path, nothing captured.
        eng.generate(input_ids=list(range(1, 21)), sampling_params=one)
        assert capturer.sessions == 2
        assert phase_info(eng, "prefill")["uncaptured_runs"] == 1
        assert states(eng, "prefill") == {8: ("captured", 2), 16: ("unseen", 0)}


def test_upfront_captures_every_bucket_before_serving(
    tiny_llama: Path,
    tmp_path: Path,
    capturer: EmulatedCapturer,
    reference: list[list[int]],
) -> None:
    with make_engine(
        tiny_llama,
        tmp_path,
        cuda_graph_backend_decode="full",
        cuda_graph_backend_prefill="breakable",
        cuda_graph_capture="upfront",
    ) as eng:
        assert capturer.sessions == 5
        assert all(s == ("captured", 0) for s in states(eng, "decode").values())
        assert all(s == ("captured", 0) for s in states(eng, "prefill").values())
        assert eng.get_server_info()["runner"]["capture_s"] > 0
        assert generate(eng) == reference
        assert capturer.sessions == 5


def test_manifest_prewarms_the_buckets_the_last_run_hit(
    tiny_llama: Path,
    tmp_path: Path,
    capturer: EmulatedCapturer,
    reference: list[list[int]],
) -> None:
    with make_engine(tiny_llama, tmp_path, cuda_graph_backend_decode="full") as eng:
        eng.generate(input_ids=PROMPTS[:2], sampling_params=PARAMS[:2])  # decode buckets 2, 1
    assert capturer.sessions == 2
    with make_engine(
        tiny_llama, tmp_path, cuda_graph_backend_decode="full", cuda_graph_capture="manifest"
    ) as eng:
        assert capturer.sessions == 4
        assert states(eng, "decode") == {1: ("captured", 0), 2: ("captured", 0), 4: ("unseen", 0)}
        assert generate(eng) == reference  # then lazily: bucket 4 on its first hit
        assert capturer.sessions == 5


def test_over_budget_captures_are_skipped(
    tiny_llama: Path,
    tmp_path: Path,
    capturer: EmulatedCapturer,
    reference: list[list[int]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    capturer.peak = 10**9  # every warm-up peaks at 1 GB; the budget is 0.05% of 1 TiB
    with make_engine(
        tiny_llama,
        tmp_path,
        cuda_graph_backend_decode="full",
        cuda_graph_backend_prefill="breakable",
        cuda_graph_mem_fraction=0.0005,
    ) as eng:
        with caplog.at_level(logging.WARNING, logger="srt.model_executor.graphs.pool"):
            assert generate(eng) == reference
            assert generate(eng) == reference
        assert capturer.sessions == 0
        skips = [r for r in caplog.records if "skipping the capture" in r.getMessage()]
        assert len(skips) == 5  # once per bucket: decode 4, 2, 1; prefill 16, 8
        assert states(eng, "decode") == {1: ("skipped", 0), 2: ("skipped", 0), 4: ("skipped", 0)}
        info = eng.get_server_info()["runner"]["graph_pool"]
        assert info["skips"] == 5 and info["captures"] == 0


def test_without_a_capturer_the_uncaptured_path_runs(
    tiny_llama: Path,
    tmp_path: Path,
    reference: list[list[int]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="srt.model_executor.graphs.graph_runner"):
        eng = make_engine(
            tiny_llama,
            tmp_path,
            cuda_graph_backend_decode="full",
            cuda_graph_backend_prefill="breakable",
            cuda_graph_capture="upfront",
        )
    with eng:
        assert generate(eng) == reference
        assert generate(eng) == reference
        notes = [r.getMessage() for r in caplog.records if "nothing to capture" in r.getMessage()]
        assert len(notes) == 2  # once per phase
        assert all(s == ("unseen", 0) for s in states(eng, "decode").values())
        assert phase_info(eng, "decode")["uncaptured_runs"] > 0


def test_full_capture_of_the_compiled_general_graph(
    tiny_llama: Path,
    tmp_path: Path,
    capturer: EmulatedCapturer,
    reference: list[list[int]],
) -> None:
    """Compile once, capture per bucket: both phases `full` with a tc compiler trace the model
    once, and each bucket's capture records the compiled forward whole (pieces and attention);
    a batch beyond the largest bucket runs the same compiled graph uncaptured."""
    with make_engine(
        tiny_llama,
        tmp_path,
        cuda_graph_backend_decode="full",
        cuda_graph_backend_prefill="full",
        cuda_graph_tc_compiler="eager",
    ) as eng:
        assert generate(eng) == reference
        runs = phase_info(eng, "decode")["forward"]["general_runs"]  # warm-ups and captures
        assert generate(eng) == reference
        info = eng.get_server_info()
        assert info["runner"]["compile"]["traces"] == 1
        assert info["runner"]["compile"]["num_pieces"] == eng.model_config.num_layers + 1
        decode = phase_info(eng, "decode")
        assert decode["forward"]["tc_compiler"] == "eager"
        assert states(eng, "decode") == {4: ("captured", 4), 2: ("captured", 4), 1: ("captured", 6)}
        # One session per bucket (decode 4, 2, 1; prefill 16, 8), the whole forward in each.
        assert capturer.sessions == len(eng.runner.graph_pool.labels) == 5
        assert decode["forward"]["general_runs"] == runs  # replays run no piece from Python
        long_prompt = [list(range(1, 40))]  # 39 tokens: beyond the largest prefill bucket
        eng.generate(input_ids=long_prompt, sampling_params=PARAMS[0])
        assert phase_info(eng, "prefill")["uncaptured_runs"] == 1


def test_full_with_a_tc_compiler_runs_the_compiled_graph_on_the_cpu(
    tiny_llama: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    with make_engine(
        tiny_llama, tmp_path, cuda_graph_backend_decode="full", cuda_graph_tc_compiler="eager"
    ) as eng:
        assert generate(eng) == reference
        decode = phase_info(eng, "decode")
        assert decode["uncaptured_runs"] == decode["forward"]["general_runs"] > 0
        prefill = phase_info(eng, "prefill")
        assert prefill["backend"] == "disabled" and prefill["capture"] is None
        assert prefill["forward"] == {**prefill["forward"], "kind": "eager"}


# ---- tc_piecewise: the piece capture, through the compilation layer's dispatcher -----------


def test_piece_graphs_capture_each_piece_of_a_bucket_in_its_session() -> None:
    """Two pieces around an eager 'attention' that writes into the first piece's output: the
    bucket's warm-up is each piece's first hit, the recording forward (inside the bucket's
    one capture session) captures both, later hits replay them."""
    capturer = EmulatedCapturer()
    pool = GraphPool(torch.device("cpu"), mem_fraction=0.5)
    pool.capturer = capturer
    weight = torch.nn.Linear(4, 4)
    specializer = PieceGraphs(weight)
    pieces = [
        lambda x, w: (x @ w, torch.empty_like(x)),
        lambda h, out, w: (h + out) @ w,
    ]
    dispatcher = BucketDispatcher(pieces, specializer)

    def forward(x: torch.Tensor, bucket: int | None) -> torch.Tensor:
        h, out = dispatcher.run(0, bucket, (x, weight.weight))
        out.copy_(h.relu() * 2)  # the split op, eager between the pieces
        return dispatcher.run(1, bucket, (h, out, weight.weight))

    def expected(x: torch.Tensor) -> torch.Tensor:
        h = x @ weight.weight
        return (h + h.relu() * 2) @ weight.weight

    def record(session: Any) -> None:
        with specializer.capturing(session):
            torch.testing.assert_close(forward(x, 4), expected(x))

    with torch.inference_mode():
        x = torch.randn(4, 4)
        captured = pool.capture("bucket 4", lambda: forward(x, 4), record, warmup_runs=1)
        assert captured is not None and capturer.sessions == 1 and len(capturer.graphs) == 2
        assert specializer.captured == {4: 2}
        for _ in range(3):
            x = torch.randn(4, 4)
            torch.testing.assert_close(forward(x, 4), expected(x))
        # The recording hit replays what it captured (a CUDA capture computes nothing), and
        # so does every later hit: both pieces each time.
        assert capturer.replays == 2 * 4
        x = torch.randn(2, 4)
        torch.testing.assert_close(forward(x, None), expected(x))  # no bucket: general
        assert capturer.sessions == 1
        stats = dispatcher.bucket_stats()[4]
        assert stats["state"] == "replayed" and stats["hits"] == 5


def test_a_piece_outside_its_bucket_capture_is_an_error() -> None:
    specializer = PieceGraphs(torch.nn.Linear(2, 2))
    dispatcher = BucketDispatcher([lambda x: x * 3], specializer)
    dispatcher.run(0, 8, (torch.randn(8),))  # the first hit runs the general piece
    with pytest.raises(RuntimeError, match="outside the bucket's capture"):
        dispatcher.run(0, 8, (torch.randn(8),))


def test_tc_piecewise_piece_graphs_give_the_eager_ids(
    tiny_llama: Path,
    tmp_path: Path,
    capturer: EmulatedCapturer,
    reference: list[list[int]],
) -> None:
    with make_engine(
        tiny_llama,
        tmp_path,
        cuda_graph_backend_decode="tc_piecewise",
        cuda_graph_backend_prefill="tc_piecewise",
    ) as eng:
        pieces = eng.model_config.num_layers + 1
        # A bucket's first hit warms its pieces up and captures them (two forwards in that
        # step, as with every capture kind); later hits replay.
        assert generate(eng) == reference
        assert generate(eng) == reference
        labels = eng.runner.graph_pool.labels
        # Decode buckets 4, 2, 1 and the prefill buckets 16 (the first round) and 8
        # (prefix-cached rounds): one session each, every piece captured exactly once in it.
        assert capturer.sessions == len(labels) == 5 and max(labels.values()) == 1
        assert len(capturer.graphs) == 5 * pieces and capturer.replays > 0
        decode = phase_info(eng, "decode")
        assert decode["captured"] == [1, 2, 4]
        assert decode["capture"]["pieces_captured"] == 3 * pieces
