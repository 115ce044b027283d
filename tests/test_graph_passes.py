"""The graph pass manager (`srt.compilation.graph_passes`): which passes `--compile-passes`
turns on and in what order, each run inside Inductor's compiles and logged with its matches,
artifacts compiled with other passes kept apart, and the flag's errors (CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from compile_helpers import count_rsqrt, greedy_ids, tc_engine
from torch import fx

from srt.compilation import graph_passes
from srt.compilation.graph_passes import (
    applying,
    passes_tag,
    register_graph_pass,
    resolve_passes,
)
from srt.compilation.graph_passes import (
    graph_passes as registered,
)
from srt.model_executor.graphs.config import GraphConfigError


def test_passes_resolve_by_name_in_their_order(graph_pass_registry: None) -> None:
    def noop(graph: fx.Graph) -> int:
        return 0

    register_graph_pass("zeta")(noop)
    register_graph_pass("alpha", after=("zeta",))(lambda g: 0)
    register_graph_pass("whole", whole_graph=True)(lambda g: 0)
    names = list(registered())
    assert names.index("zeta") < names.index("alpha")  # `after` wins over the names' order
    assert resolve_passes(["alpha,zeta"]) == ["zeta", "alpha"]
    assert resolve_passes(["zeta", "alpha"]) == ["zeta", "alpha"]
    assert set(resolve_passes(["all"])) == set(names)
    assert resolve_passes(["none"]) == [] and resolve_passes(None) == []
    assert resolve_passes(None, default=["zeta"]) == ["zeta"]
    assert graph_passes.whole_graph_passes(["zeta", "whole"]) == ["whole"]
    for bad, message in [
        (["nope"], "unknown graph pass"),
        (["all", "zeta"], "stand alone"),
        ([","], "got nothing"),
    ]:
        with pytest.raises(ValueError, match=message):
            resolve_passes(bad)
    with pytest.raises(ValueError, match="registered twice"):
        register_graph_pass("zeta")(lambda g: 0)
    register_graph_pass("zeta")(noop)  # the same function again: a re-import, not an error
    assert passes_tag([]) == "" and passes_tag(["zeta"]) != passes_tag(["alpha"])


def test_passes_running_in_a_circle_are_refused(graph_pass_registry: None) -> None:
    register_graph_pass("ping", after=("pong",))(lambda g: 0)
    register_graph_pass("pong", after=("ping",))(lambda g: 0)
    with pytest.raises(ValueError, match="circle"):
        registered()


def test_applying_runs_the_passes_in_inductor_and_logs_them(graph_pass_registry: None) -> None:
    register_graph_pass("count_rsqrt")(count_rsqrt)

    def norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    x = torch.randn(4, 8)
    torch._dynamo.reset()
    # Inductor's caches off: a hit from an earlier run would skip the passes (they ran then).
    no_caches = torch._inductor.config.patch(force_disable_caches=True)
    with no_caches, applying(["count_rsqrt"]) as log:
        out = torch.compile(norm, backend="inductor", fullgraph=True)(x)
    assert log.matches == {"count_rsqrt": [1]} and log.totals() == {"count_rsqrt": 1}
    torch.testing.assert_close(out, norm(x))
    with applying([]) as nothing:  # no passes: Inductor's config untouched
        assert nothing.matches == {}


def test_a_pass_runs_in_every_piece_and_its_artifacts_are_its_own(
    graph_pass_registry: None, tiny_llama: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    """Piecewise mode: the pass sees each distinct piece (the tiny model's 2 layers: 5
    RMSNorms over 3 distinct pieces); a warm start loads what it compiled (nothing runs it
    again); every artifact's name carries the passes it was compiled with."""
    register_graph_pass("count_rsqrt")(count_rsqrt)
    cache = tmp_path / "cache"
    with tc_engine(tiny_llama, cache, "inductor", compile_passes=["count_rsqrt"]) as eng:
        info = eng.get_server_info()["compile"]
        assert greedy_ids(eng) == reference
    assert info["passes"] == ["count_rsqrt"] and info["cache_hit"] is False
    # Pieces: layer 0's input norm (embedding piece), layer 0's post norm + layer 1's input
    # norm (middle), layer 1's post norm + the final norm (last): 1 + 2 + 2.
    assert info["pass_matches"] == {"count_rsqrt": 5}
    names = [p["signature"] for p in info["pieces"]]
    assert len(set(names)) == 3
    with tc_engine(tiny_llama, cache, "inductor", compile_passes=["count_rsqrt"]) as eng:
        warm = eng.get_server_info()["compile"]
    assert warm["cache_hit"] is True and warm["pass_matches"] is None
    artifacts = {p.name for p in cache.rglob("inductor-*.bin")}
    assert artifacts and all(passes_tag(["count_rsqrt"]) in a for a in artifacts)


def test_the_flag_is_checked_before_anything_compiles(
    graph_pass_registry: None, tiny_llama: Path, tmp_path: Path
) -> None:
    register_graph_pass("across_splits", whole_graph=True)(lambda g: 0)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"compile_passes": ["no_such_pass"]}, "--compile-passes: unknown graph pass"),
        ({"compile_passes": ["across_splits"]}, "need\\(s\\) --inductor-graph-partition"),
    ]
    for options, message in cases:
        with pytest.raises(GraphConfigError, match=message):
            tc_engine(tiny_llama, tmp_path, "inductor", **options)


def test_all_leaves_out_what_the_mode_cannot_run(
    graph_pass_registry: None, tiny_llama: Path, tmp_path: Path
) -> None:
    """`all` in the piecewise mode: every pass but those that need the partition mode."""
    register_graph_pass("across_splits", whole_graph=True)(lambda g: 0)
    register_graph_pass("count_rsqrt")(count_rsqrt)
    with tc_engine(tiny_llama, tmp_path, "inductor", compile_passes=["all"]) as eng:
        passes = eng.get_server_info()["compile"]["passes"]
    assert "count_rsqrt" in passes and "across_splits" not in passes
