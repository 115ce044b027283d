"""The sequence-parallel graph pass (`srt.layers.sequence_parallel`) and its collectives over
the token rows (`srt.distributed`), on the CPU: the collectives on two gloo ranks against the
all-reduce, the rewrite of a hand-built graph, and two ranks through the Engine in the
partition mode giving the ids of one rank. The 2-GPU check (NCCL in CUDA graphs) is marked gpu
(tests/test_tensor_parallel.py's style)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from compile_helpers import greedy_ids, tc_engine
from torch import fx

from srt import Engine
from srt.layers.layernorm import rms_norm
from srt.layers.sequence_parallel import shard_residual_stream
from srt.model_executor.graphs.config import GraphConfigError
from srt.tp_rank import TPRank, tp_ranks

SP = {"inductor_graph_partition": True, "compile_passes": ["sequence_parallel"]}
# Prompts of 4 + 6 tokens: an even prefill (compile_helpers' prompts make an odd one, 15).
EVEN_PROMPTS = [[2, 4, 6, 8], [1, 3, 5, 7, 9, 11]]


def _collectives_on_a_rank(rank: int, init_method: str) -> None:
    """One rank of the collectives test: every row count, odd, even and below the ranks'."""
    from srt import distributed

    distributed.init_tp(TPRank(rank, 2, init_method), torch.device("cpu"))
    ops = torch.ops.srt
    try:
        for total in (1, 2, 3, 4, 7, 10):
            x = torch.randn(total, 6, generator=torch.Generator().manual_seed(10 * total + rank))
            summed = distributed.all_reduce(x)
            rows = max(-(-total // 2), 2)  # ceil(T/n), never a 1-row shard
            padded = torch.cat([summed, summed.new_zeros(2 * rows - total, 6)])
            mine = padded[rank * rows : (rank + 1) * rows]
            shard = ops.tp_reduce_scatter_rows(x, 2)
            assert shard.shape == (rows, 6), (total, shard.shape)
            torch.testing.assert_close(shard, mine)
            assert torch.equal(ops.tp_row_shard(summed, 2), mine)
            gathered = ops.tp_all_gather_rows(shard, total, 2)
            assert gathered.shape == (total, 6)
            torch.testing.assert_close(gathered, summed)
    finally:
        distributed.destroy_tp()


def test_the_row_collectives_match_the_all_reduce() -> None:
    [first, _] = tp_ranks(2)
    assert first.init_method is not None
    torch.multiprocessing.spawn(_collectives_on_a_rank, args=(first.init_method,), nprocs=2)


def _decoder(layers: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The residual stream of a tensor-parallel decoder as the tiny Llama's: the embedding's
    all-reduce and plain norm, per layer two all-reduces into an add + norm (a matmul for each
    sublayer), the final norm; it returns the normed output and the last summed residual."""

    def forward(
        embedded: torch.Tensor, w: torch.Tensor, norm_w: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = torch.ops.srt.tp_all_reduce(embedded)
        hidden = rms_norm(residual, norm_w, 1e-6)
        for _ in range(2 * layers):
            out = torch.ops.srt.tp_all_reduce(hidden @ w)
            residual = out + residual
            hidden = rms_norm(residual, norm_w, 1e-6)
        return hidden, residual

    return forward


def _traced(layers: int, dtype: torch.dtype) -> fx.Graph:
    """`_decoder` as Inductor's post-grad graph has it: aten with Inductor's decompositions and
    a symbolic token count (odd here)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    args = (
        torch.randn(5, 8, dtype=dtype),
        torch.randn(8, 8, dtype=dtype),
        torch.ones(8, dtype=dtype),
    )
    traced = make_fx(
        _decoder(layers), tracing_mode="symbolic", decomposition_table=select_decomp_table()
    )(*args)
    return traced.graph


def _calls(graph: fx.Graph, name: str) -> list[fx.Node]:
    op = getattr(torch.ops.srt, name).default
    return [n for n in graph.nodes if n.op == "call_function" and n.target is op]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_pass_shards_the_residual_between_sites(dtype: torch.dtype) -> None:
    graph = _traced(layers=2, dtype=dtype)
    full_rows = next(iter(graph.nodes)).meta["val"].shape[0]
    assert shard_residual_stream(graph, world_size=2) == 4
    graph.lint()
    # The embedding's all-reduce feeds a plain norm: not a site, it stays.
    assert len(_calls(graph, "tp_all_reduce")) == 1
    assert len(_calls(graph, "tp_reduce_scatter_rows")) == 4
    # Only the first site takes its rows of a full residual (the embedding's sum).
    [first_rows] = _calls(graph, "tp_row_shard")
    assert first_rows.args[0] is _calls(graph, "tp_all_reduce")[0]
    # Gathered: each site's normed rows (what the next matmul reads) and the last summed
    # residual (a graph output); no other summed residual is gathered.
    gathers = _calls(graph, "tp_all_gather_rows")
    assert len(gathers) == 5
    (output,) = [n for n in graph.nodes if n.op == "output"]
    assert all(isinstance(o, fx.Node) and o in gathers for o in output.args[0])
    # Between the sites every summed residual (an add with a reduce-scattered operand) is a
    # shard, of the rows of the first site's: ceil(T/2) (2 at least), never T.
    sums = [
        n
        for n in graph.nodes
        if n.target is torch.ops.aten.add.Tensor
        and any(a in _calls(graph, "tp_reduce_scatter_rows") for a in n.args)
    ]
    assert len(sums) == 4
    for node in sums:
        rows = node.meta["val"].shape[0]
        assert (
            str(rows) != str(full_rows) and node.meta["val"].shape == first_rows.meta["val"].shape
        )
        (residual,) = [a for a in node.args if a not in _calls(graph, "tp_reduce_scatter_rows")]
        assert residual is first_rows or residual in sums


def test_a_graph_without_all_reduce_is_left_alone() -> None:
    """One rank's graph: the same decoder with no collectives (the model calls none)."""
    graph = _traced(layers=1, dtype=torch.float32)
    for node in _calls(graph, "tp_all_reduce"):
        (source,) = node.all_input_nodes
        node.replace_all_uses_with(source)
        graph.erase_node(node)
    before = str(graph)
    assert shard_residual_stream(graph, world_size=2) == 0
    assert str(graph) == before


def test_two_ranks_with_the_pass_give_the_ids_of_one(
    tiny_llama: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    """Prefill of 15 tokens (odd) and of 10 (even); decode of 3, 2 and 1 requests: the same ids
    as one rank uncompiled and as the same engine without the pass; 2 sites per layer."""
    with Engine(model_path=str(tiny_llama), device="cpu", dtype="float32") as eng:
        even_reference = greedy_ids(eng, EVEN_PROMPTS)
    with tc_engine(
        tiny_llama, tmp_path / "on", "inductor", tp_size=2, skip_warmup=True, **SP
    ) as eng:
        assert greedy_ids(eng) == reference
        assert greedy_ids(eng, EVEN_PROMPTS) == even_reference
        info = eng.get_server_info()["compile"]
    assert info["passes"] == ["sequence_parallel"]
    assert info["pass_matches"] == {"sequence_parallel": 4}
    without = {"inductor_graph_partition": True}
    with tc_engine(
        tiny_llama, tmp_path / "off", "inductor", tp_size=2, skip_warmup=True, **without
    ) as eng:
        assert greedy_ids(eng) == reference
        assert greedy_ids(eng, EVEN_PROMPTS) == even_reference


def test_the_piecewise_mode_refuses_the_pass(tiny_llama: Path, tmp_path: Path) -> None:
    with pytest.raises(GraphConfigError, match="sequence_parallel .*--inductor-graph-partition"):
        tc_engine(tiny_llama, tmp_path, "inductor", compile_passes=["sequence_parallel"])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("capture", ["full", "tc_piecewise"])
def test_two_gpus_with_the_pass_give_the_same_ids(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, capture: str
) -> None:
    """NCCL's reduce-scatter and all-gather captured in CUDA graphs (per partition and bucket
    with tc_piecewise, the whole forward with full): the ids without the pass, and decode
    replays. float32 as tests/test_tensor_parallel.py's 2-GPU test, so that a changed fusion
    cannot flip a greedy pick (the bf16 form's matching is the hand-built graph test's)."""
    model = tiny_model_factory("llama", num_kv_heads=2, dtype="bfloat16")
    options = {
        "device": "cuda",
        "dtype": "float32",
        "tp_size": 2,
        "cuda_graph_backend_prefill": capture,
        "cuda_graph_backend_decode": capture,
        "cuda_graph_tc_compiler": "inductor",
        "cuda_graph_bs_prefill": [8, 16],
        "cuda_graph_bs_decode": [1, 2, 4],
        "inductor_graph_partition": True,
        "max_total_tokens": 4096,
    }
    ids = {}
    for passes in (["none"], ["sequence_parallel"]):
        with Engine(
            model_path=str(model),
            compile_cache_dir=str(tmp_path / passes[0]),
            compile_passes=passes,
            **options,
        ) as engine:
            ids[passes[0]] = [greedy_ids(engine), greedy_ids(engine, EVEN_PROMPTS)]
            assert greedy_ids(engine) == ids[passes[0]][0]  # replays the captured graphs
            info = engine.get_server_info()["compile"]
            decode = engine.get_server_info()["graphs"]["decode"]
        assert any(b["state"] == "captured" and b["replays"] > 1 for b in decode["buckets"])
        if passes == ["sequence_parallel"]:
            assert info["pass_matches"] == {"sequence_parallel": 4}, info
        else:
            assert info["passes"] == [], info
    assert ids["sequence_parallel"] == ids["none"]
