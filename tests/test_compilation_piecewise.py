"""tc_piecewise with the `eager` piece compiler: the split (L regions, L + 1 pieces), the dumped
graph, trace once (no Dynamo compilation for any later batch size), parity with the uncompiled
forward, bucket states and the manifest, the cache key and its private directories, and the
errors for models that cannot be traced once."""

from __future__ import annotations

import inspect
import json
import logging
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from compile_helpers import (
    LADDERS,
    PROMPTS,
    greedy_ids,
    make_plan,
    max_logit_error,
    no_trace,
    tc_engine,
)
from graph_emulation import EmulatedCapturer
from torch import fx, nn

import srt.model_executor.graphs.pool as graph_memory
from srt import Engine
from srt.batch_layout import ForwardMode
from srt.compilation.cache import CompileCache
from srt.compilation.cache_key import CacheFactors, collect_factors
from srt.compilation.dispatch import BucketDispatcher
from srt.compilation.errors import GraphBreakError, ShapeSpecializationError
from srt.compilation.piecewise_model import PiecewiseModel
from srt.compilation.split import split_graph

Factory = Callable[..., Path]


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compile-cache") / "root"


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, cache_root: Path) -> Iterator[Engine]:
    with tc_engine(tiny_llama, cache_root, "eager") as eng:
        yield eng


@pytest.fixture(scope="module")
def three_layers(tiny_model_factory: Factory, cache_root: Path) -> Iterator[Engine]:
    with tc_engine(tiny_model_factory("llama", num_layers=3), cache_root, "eager") as eng:
        yield eng


def compile_info(eng: Engine) -> dict:
    return eng.get_server_info()["compile"]


# ---- the split -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["engine", "three_layers"])
def test_llama_splits_into_one_region_per_layer(name: str, request: pytest.FixtureRequest) -> None:
    eng: Engine = request.getfixturevalue(name)
    layers = eng.model_config.num_layers
    info = compile_info(eng)
    assert info["split_ops"] == ["srt::attention"]
    assert (info["num_split_regions"], info["num_pieces"]) == (layers, layers + 1)
    # First piece (embedding), middle pieces (identical: one artifact), last piece (final norm).
    assert info["num_unique_pieces"] == 3
    middle = {p["signature"] for p in info["pieces"][1:-1]}
    assert len(middle) == 1
    shared = [p["piece"] for p in info["pieces"] if p["eager"]["source"] == "shared"]
    assert shared == list(range(2, layers))
    general = eng.runner.piecewise.general("eager")
    assert all(general[i] is general[1] for i in shared)
    assert info["traces"] == 1 and info["total_s"] >= info["compile_s"] > 0
    assert info["cache_hit"] is None  # nothing to cache with the eager compiler


def test_consecutive_split_ops_share_one_region() -> None:
    attention = torch.ops.srt.attention.default

    def forward(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        q = q * 2
        attention(q, kv, kv, out, kv, kv, 1.0)
        attention(q, kv, kv, out, kv, kv, 1.0)
        return out + q

    split = split_graph(fx.symbolic_trace(forward))
    assert (len(split.pieces), len(split.regions)) == (2, 1)
    assert split.submodules == [split.pieces[0], split.regions[0], split.pieces[1]]
    assert split.region_ops[split.regions[0]] == ["srt::attention"] * 2


def test_dumped_graph_names_every_piece(three_layers: Engine) -> None:
    info = compile_info(three_layers)
    text = (Path(info["cache_dir"]) / "computation_graph.py").read_text()
    for piece in info["pieces"]:
        assert f"{piece['submodule']}: piece {piece['piece']} (compiled" in text
        assert f"class {piece['submodule']}(torch.nn.Module)" in text
    for region in range(info["num_split_regions"]):
        assert f"split region {region} (eager: srt::attention)" in text
    compile(text, "computation_graph.py", "exec")  # it is Python


def test_no_tc_phase_still_reports_the_split_ops(tiny_llama: Path) -> None:
    with Engine(model_path=str(tiny_llama), device="cpu") as eng:
        info = eng.get_server_info()["compile"]
    assert info == {
        "split_ops": ["srt::attention"],
        "mode": None,
        "passes": [],
        "pass_matches": None,
        "num_pieces": 0,
        "num_split_regions": 0,
        "num_unique_pieces": 0,
        "compilers": [],
        "graph_source": None,
        "bound": None,
        "dynamo_s": 0.0,
        "graph_load_s": 0.0,
        "compile_s": 0.0,
        "total_s": 0.0,
        "cache_dir": None,
        "cache_hit": None,
        "traces": 0,
        "pieces": [],
    }


# ---- traced once; parity ---------------------------------------------------------------------


def test_every_batch_size_runs_without_a_new_dynamo_compilation(engine: Engine) -> None:
    runner = engine.runner
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        for n in range(1, 21):  # both phases, inside and beyond the ladders
            runner.forward_logits(make_plan(ForwardMode.EXTEND, [[3] * n], [0]))
            decode = make_plan(ForwardMode.DECODE, [[4]] * n, [1] * n)
            runner.forward_logits(decode)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert compile_info(engine)["traces"] == 1


def test_greedy_ids_and_logits_match_the_uncompiled_model(
    engine: Engine, reference: list[list[int]]
) -> None:
    assert greedy_ids(engine) == reference
    assert max_logit_error(engine.runner) <= 1e-5


# ---- warm start: the saved graph instead of the trace ------------------------------------------


def test_a_warm_start_loads_the_graph_instead_of_tracing(
    engine: Engine,
    tiny_llama: Path,
    cache_root: Path,
    reference: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cold = compile_info(engine)
    assert (cold["graph_source"], cold["graph_load_s"]) == ("traced", 0.0)
    # Eager pieces load without Dynamo: the split graph is saved bound, not as Dynamo's capture.
    assert (Path(cold["cache_dir"]) / "pieces" / "bound-graph-eager-t8192.bin").is_file()
    assert cold["bound"] is True
    no_trace(monkeypatch)
    with tc_engine(tiny_llama, cache_root, "eager") as warm:
        info = compile_info(warm)
        assert greedy_ids(warm) == reference
        assert max_logit_error(warm.runner) <= 1e-5
        runner = warm.runner
        with torch.inference_mode():  # every size, and no Dynamo behind any of them
            for n in (1, 3, 20):
                runner.forward_logits(make_plan(ForwardMode.EXTEND, [[3] * n], [0]))
    assert info["cache_dir"] == cold["cache_dir"]
    assert (info["graph_source"], info["traces"], info["dynamo_s"]) == ("loaded", 0, 0.0)
    assert info["graph_load_s"] > 0 and info["total_s"] >= info["graph_load_s"]
    assert [p["signature"] for p in info["pieces"]] == [p["signature"] for p in cold["pieces"]]
    assert (info["num_pieces"], info["num_split_regions"]) == (3, 2)


def test_a_damaged_saved_graph_is_traced_again(
    engine: Engine,
    tiny_llama: Path,
    reference: list[list[int]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    entry = Path(compile_info(engine)["cache_dir"])
    root = tmp_path / "root"
    shutil.copytree(entry, root / entry.name)
    saved = root / entry.name / "pieces" / "bound-graph-eager-t8192.bin"
    data = bytearray(saved.read_bytes())
    data[-100] ^= 0xFF  # inside the payload: the checksum no longer matches
    saved.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING), tc_engine(tiny_llama, root, "eager") as again:
        info = compile_info(again)
        assert greedy_ids(again) == reference
    assert (info["graph_source"], info["traces"]) == ("traced", 1)
    assert f"artifact {saved} is corrupted or mismatched (ValueError: checksum" in caplog.text
    assert saved.read_bytes() != bytes(data)  # written again, whole
    with tc_engine(tiny_llama, root, "eager") as third:
        assert compile_info(third)["graph_source"] == "loaded"


@pytest.fixture
def capturer(monkeypatch: pytest.MonkeyPatch) -> EmulatedCapturer:
    """CUDA graph capture emulated on the CPU (tests/graph_emulation.py)."""
    emulated = EmulatedCapturer()
    monkeypatch.setattr(graph_memory, "default_capturer", lambda device: emulated)
    return emulated


def test_bucket_states_and_the_manifest(
    tiny_llama: Path, tmp_path: Path, capturer: EmulatedCapturer
) -> None:
    with tc_engine(tiny_llama, tmp_path, "eager", enable_prefix_caching=False) as eng:
        one = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
        eng.generate(input_ids=PROMPTS[0], sampling_params=one)  # prefill 5 tokens, 2 decodes
        graphs = eng.get_server_info()["graphs"]
        decode = {b["bucket"]: b for b in graphs["decode"]["buckets"]}
        prefill = {b["bucket"]: b for b in graphs["prefill"]["buckets"]}
        # A bucket's first hit captures it (and replays); the second only replays.
        assert (decode[1]["state"], decode[1]["replays"]) == ("captured", 2)
        assert (decode[2]["state"], decode[4]["state"]) == ("unseen", "unseen")
        assert (prefill[8]["state"], prefill[8]["replays"]) == ("captured", 1)
        assert (graphs["decode"]["captured"], graphs["prefill"]["captured"]) == ([1], [8])
        pieces = graphs["decode"]["capture"]["pieces_captured"]
        eng.generate(input_ids=PROMPTS[0], sampling_params=one)
        graphs = eng.get_server_info()["graphs"]
        decode = {b["bucket"]: b for b in graphs["decode"]["buckets"]}
        assert (
            decode[1]["replays"] == 4 and graphs["decode"]["capture"]["pieces_captured"] == pieces
        )
        eng.generate(input_ids=list(range(1, 30)), sampling_params=one)  # beyond bucket 16
        prefill_info = eng.get_server_info()["graphs"]["prefill"]
        assert prefill_info["forward"]["general_runs"] == prefill_info["uncaptured_runs"] == 1
        manifest = Path(compile_info(eng)["cache_dir"]) / "manifest.json"
        assert json.loads(manifest.read_text()) == {"buckets": {"prefill": [8], "decode": [1]}}


def test_upfront_specialises_every_bucket_before_serving(
    tiny_llama: Path, tmp_path: Path, capturer: EmulatedCapturer
) -> None:
    with tc_engine(tiny_llama, tmp_path, "eager", cuda_graph_capture="upfront") as eng:
        graphs = eng.get_server_info()["graphs"]
        for phase, ladder in (
            ("prefill", "cuda_graph_bs_prefill"),
            ("decode", "cuda_graph_bs_decode"),
        ):
            states = {b["bucket"]: b["state"] for b in graphs[phase]["buckets"]}
            assert states == dict.fromkeys(LADDERS[ladder], "captured")
        # Prewarming is not traffic: the manifest stays empty.
        assert not (Path(compile_info(eng)["cache_dir"]) / "manifest.json").exists()


def test_on_the_cpu_tc_piecewise_runs_the_general_graph(tiny_llama: Path, tmp_path: Path) -> None:
    """Nothing to capture: every batch runs the compiled general graph unpadded."""
    with tc_engine(tiny_llama, tmp_path, "eager") as eng:
        eng.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 3})
        decode = eng.get_server_info()["graphs"]["decode"]
        assert (
            decode["captured"] == []
            and decode["uncaptured_runs"] == decode["forward"]["general_runs"]
        )
        assert decode["forward"]["general_runs"] >= 2


# ---- the cache key and its directories --------------------------------------------------------


def test_cache_key_follows_dtype_and_layer_count(
    tiny_llama: Path, cache_root: Path, engine: Engine, three_layers: Engine
) -> None:
    with tc_engine(tiny_llama, cache_root, "eager", dtype="bfloat16") as bf16:
        dirs = {compile_info(e)["cache_dir"] for e in (engine, three_layers, bf16)}
    assert len(dirs) == 3 and all(Path(d).parent == cache_root for d in dirs)


# A different value of each option in the key: a start that changes one must miss.
OPTION_CHANGES = {
    "context_length": 4096,  # past max_position_embeddings: larger rotary tables
    "tp_size": 2,
    "max_running_requests": 64,
    "max_prefill_tokens": 4096,
    "enable_torch_compile": True,
    "torch_compile_max_bs": 8,
    "keep_shape_guards": True,
    "skinny_matmul_launch": "pdl",  # the kernel's launch: a constant of the traced graph
    "inductor_graph_partition": True,
    "compile_passes": ["all"],
}
# Options that reach the graph as this process resolves them.
RESOLVED_CHANGES = {
    "dtype": "bfloat16",
    "attention_backend": "triton",
    "cuda_graph_backend_decode": "full",
    "cuda_graph_tc_compiler": "eager",
    "cuda_graph_config": '{"prefill": {"backend": "disabled"}}',
}
# Options that cannot reach a graph: a restart that changes one still hits.
UNSEEN_CHANGES = {
    "port": 31000,
    "host": "0.0.0.0",
    "api_key": "secret-key",
    "log_level": "debug",
    "seed": 7,
    "max_total_tokens": 1000,
    "cuda_graph_bs_decode": [1, 2],
    "cuda_graph_capture": "upfront",
    "compile_cache_dir": "/elsewhere",
    "enable_mixed_chunk": True,
    "skip_warmup": True,
}


def setup_factors(
    model: Path, missing: str | None = "no kernels on cpu", rank: int = 0, **changes: object
) -> CacheFactors:
    """The compile cache factors of a CPU runner started with `changes`, resolved as the
    runner resolves them (nothing is built or compiled)."""
    from srt.model_config import ModelConfig
    from srt.model_executor.graphs.config import resolve_graph_config
    from srt.model_executor.runner_setup import attention_backend_name, compile_cache_factors
    from srt.models.llama import LlamaForCausalLM
    from srt.op_selection import resolve_custom_ops
    from srt.server_args import ServerArgs
    from srt.tp_rank import TPRank

    options = {
        "model_path": str(model),
        "device": "cpu",
        "cuda_graph_backend_prefill": "tc_piecewise",
        "cuda_graph_backend_decode": "tc_piecewise",
        "cuda_graph_tc_compiler": "inductor",
        **changes,
    }
    args = ServerArgs(**options)  # type: ignore[arg-type]
    config = ModelConfig.from_path(args.model_path, args.dtype, args.context_length)
    device = torch.device(args.resolved_device())
    return compile_cache_factors(
        args,
        config,
        Path(inspect.getfile(LlamaForCausalLM)),
        device,
        attention_backend_name(args, device.type),
        resolve_graph_config(args, device.type),
        resolve_custom_ops(args.custom_ops, missing),
        TPRank(rank, args.tp_size),
        inductor="inductor",
    )


def test_every_option_that_reaches_the_graph_changes_the_key(tiny_llama: Path) -> None:
    import dataclasses

    from srt.model_executor.runner_setup import NOT_IN_COMPILE_KEY
    from srt.server_args import ServerArgs

    names = {f.name for f in dataclasses.fields(ServerArgs)}
    assert set(NOT_IN_COMPILE_KEY) <= names  # no stale entry
    # Every option in the key has a change to try here: a new one fails this line until it has.
    assert set(OPTION_CHANGES) == names - set(NOT_IN_COMPILE_KEY)
    assert set(RESOLVED_CHANGES) | set(UNSEEN_CHANGES) <= set(NOT_IN_COMPILE_KEY)
    base = setup_factors(tiny_llama).key()
    assert setup_factors(tiny_llama).key() == base
    for name, value in {**OPTION_CHANGES, **RESOLVED_CHANGES}.items():
        assert setup_factors(tiny_llama, **{name: value}).key() != base, name
    for name, value in UNSEEN_CHANGES.items():
        factors = setup_factors(tiny_llama, **{name: value})
        assert factors.key() == base, name
        assert "secret-key" not in json.dumps(dataclasses.asdict(factors), default=str)
    # Resolved here as on a GPU, where the kernels run: the layer ops' choice shapes the graph.
    kernels = setup_factors(tiny_llama, missing=None).key()
    assert setup_factors(tiny_llama, missing=None, custom_ops=["none"]).key() != kernels
    assert (
        setup_factors(tiny_llama, tp_size=2, rank=1).key()
        != setup_factors(tiny_llama, tp_size=2).key()
    )


def test_cache_key_follows_compiler_settings_not_tool_locations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def key() -> str:
        return collect_factors({"dtype": "float32"}, torch.device("cpu"), Path(__file__)).key()

    before = key()
    # Inductor itself sets these while compiling for CUDA: a second engine must still hit.
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/opt/cuda/bin/ptxas")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/elsewhere")
    assert key() == before
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")
    assert key() != before


def test_cache_key_follows_the_source(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "layer.py").write_text("SCALE = 1\n")
    model_file = source / "model.py"
    model_file.write_text("class Model: ...\n")

    def key(root: Path) -> str:
        return collect_factors(
            {"dtype": "float32"}, torch.device("cpu"), root / "model.py", source_roots=[root]
        ).key()

    before = key(source)
    assert key(source) == before
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    for f in source.iterdir():
        (moved / f.name).write_text(f.read_text())
    assert key(moved) == before  # where the checkout lives does not matter
    (source / "layer.py").write_text("SCALE = 2\n")
    assert key(source) != before


def test_cache_directories_are_private(engine: Engine, cache_root: Path) -> None:
    entry = Path(compile_info(engine)["cache_dir"])
    for d in (cache_root, entry, entry / "pieces", entry / "inductor"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for name in ("factors.json", "computation_graph.py"):
        assert stat.S_IMODE((entry / name).stat().st_mode) == 0o600, name
    factors = json.loads((entry / "factors.json").read_text())
    assert set(factors) == {"environment", "config", "code", "compiler"}


# ---- models that cannot be traced once ----------------------------------------------------------


class Toy(nn.Module):
    """A token-wise forward `(input_ids, positions) -> hidden`, optionally with a flaw."""

    def __init__(self, flaw: str | None = None) -> None:
        super().__init__()
        self.flaw = flaw
        self.embed = nn.Embedding(32, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + positions[:, None]
        if self.flaw == "shape_branch" and x.shape[0] > 4:
            x = x * 2
        if self.flaw == "one_token_branch" and x.shape[0] == 1:
            x = x * 2
        if self.flaw == "graph_break":
            torch._dynamo.graph_break()
        if self.flaw == "squeeze":  # [T, 8] for T > 1, [8] for one token
            x = x[:, None, :].squeeze()
        if self.flaw == "squeeze_named":  # a fixed dimension named: the same for every T
            x = x[:, None, :].squeeze(1)
        return self.proj(x)


def toy_model(tmp_path: Path, flaw: str | None = None, **kwargs: bool) -> PiecewiseModel:
    cache = CompileCache(tmp_path, CacheFactors({}, {"toy": flaw}, "toy", {}))
    return PiecewiseModel(Toy(flaw), compilers=["eager"], cache=cache, max_tokens=64, **kwargs)


def tokens(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n) % 32, torch.arange(n).float()


def test_a_shape_branch_fails_the_trace(tmp_path: Path) -> None:
    model = toy_model(tmp_path, "shape_branch")
    with pytest.raises(ShapeSpecializationError, match=r"depends on the token count.*`s\d+ > 4`"):
        model.trace(*tokens(8))


def test_a_branch_on_a_single_token_fails_the_trace(tmp_path: Path) -> None:
    # Dynamo's symbol starts at 2, so it decides this without a guard; the general graph
    # would silently drop the branch for the one-token batches it also serves.
    model = toy_model(tmp_path, "one_token_branch")
    with pytest.raises(ShapeSpecializationError, match=r"from 1 to 64 .*`Eq\(s\d+, 1\)`, False"):
        model.trace(*tokens(8))


def test_an_operator_deciding_on_a_single_token_fails_the_trace(tmp_path: Path) -> None:
    # squeeze() decides by itself whether the token dimension is 1: the general graph keeps
    # it (Dynamo's symbol starts at 2), while eager PyTorch drops it for one token.
    toy = Toy("squeeze")
    assert toy(*tokens(1)).shape == (8,) and toy(*tokens(3)).shape == (3, 8)
    model = toy_model(tmp_path, "squeeze")
    with pytest.raises(ShapeSpecializationError, match=r"`squeeze` may drop dimension 0") as e:
        model.trace(*tokens(8))
    assert "test_compilation_piecewise.py" in str(e.value) and "x[:, None, :].squeeze()" in str(
        e.value
    )
    named = toy_model(tmp_path, "squeeze_named")  # squeeze(1): fixed, so it traces
    named.trace(*tokens(8))
    dispatcher = BucketDispatcher(named.general("eager"))
    torch.testing.assert_close(named(*tokens(1), dispatcher, None), named.model(*tokens(1)))


def test_a_graph_break_fails_the_trace(tmp_path: Path) -> None:
    with pytest.raises(GraphBreakError, match="does not trace as one graph"):
        toy_model(tmp_path, "graph_break").trace(*tokens(8))


@pytest.mark.parametrize("keep", [False, True])
def test_shape_guards_are_dropped_unless_kept(tmp_path: Path, keep: bool) -> None:
    for source in ("traced", "loaded"):  # the guards saved with the trace come back with it
        model = toy_model(tmp_path, keep_shape_guards=keep)
        model.trace(*tokens(8))
        assert model.graph_source == source
        dispatcher = BucketDispatcher(model.general("eager"))
        assert model(*tokens(64), dispatcher, None).shape == (64, 8)
        if keep:  # debugging: a size outside the traced range [2, 64] fails, naming the guard
            with pytest.raises(RuntimeError, match=r"GuardManager check failed(.|\n)*<= 64"):
                model(*tokens(1), dispatcher, None)
        else:
            expected = model.model(*tokens(1))
            torch.testing.assert_close(model(*tokens(1), dispatcher, None), expected)
