"""The skinny matmul kernel's table: what it chooses, the committed tables, a damaged one, and
the tuning bench's sums. (The kernel against F.linear: tests/test_layer_ops.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from layer_op_cases import skinny_table_for

import srt.layers.skinny_matmul_table as table
from srt.bench.skinny_matmul import CANDIDATES, products, step_sums
from srt.layers.linear import skinny_config
from srt.layers.skinny_matmul_table import BUCKETS, SkinnyConfig, bucket, choose, shape_key


def test_rows_use_the_next_bucket_up_and_none_above() -> None:
    assert [bucket(r) for r in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert bucket(17) is None


def test_the_kernel_runs_only_where_the_table_says_it_won() -> None:
    shapes = {
        shape_key("bfloat16", 64, 32, False): {
            "1": {"choice": "triton", "config": [4, 32, 4, 2]},
            "2": {"choice": "cublas", "config": [16, 32, 4, 3]},
            "4": {"choice": "triton", "config": [16, 32, 4, 3]},
        }
    }
    with skinny_table_for("cpu", shapes):
        assert choose("cpu", "bfloat16", 64, 32, 1, False) == SkinnyConfig(4, 32, 4, 2)
        assert choose("cpu", "bfloat16", 64, 32, 2, False) is None  # cuBLAS was faster
        assert choose("cpu", "bfloat16", 64, 32, 3, False) == SkinnyConfig(16, 32, 4, 3)
        assert choose("cpu", "bfloat16", 64, 32, 8, False) is None  # not tuned there
        assert choose("cpu", "bfloat16", 64, 32, 1, True) is None  # the gated form is another
        assert choose("cpu", "float16", 64, 32, 1, False) is None
        x, w = torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(64, 32, dtype=torch.bfloat16)
        assert skinny_config(x, w, False) == SkinnyConfig(4, 32, 4, 2)
        assert skinny_config(x.float(), w, False) is None  # dtypes differ: cuBLAS decides
        assert skinny_config(x[:0], w, False) is None
        assert skinny_config(x, w.t().contiguous().t(), False) is None  # a strided weight
    assert choose("cpu", "bfloat16", 64, 32, 1, False) is None  # no table for the CPU


def test_a_damaged_table_is_an_error_naming_the_file() -> None:
    with skinny_table_for("cpu", {}) as path:
        path.write_text("{not json")
        table.load_table.cache_clear()
        with pytest.raises(ValueError, match="not a skinny matmul table"):
            choose("cpu", "bfloat16", 64, 32, 1, False)


def test_the_committed_tables_are_whole() -> None:
    files = sorted(table.TUNED_DIR.glob("skinny_matmul-*.json"))
    assert files, "no committed table"
    for path in files:
        data = json.loads(path.read_text())
        assert table.table_path(data["device"]) == path
        assert {"torch", "triton", "date", "command"} <= set(data)
        for key, per_bucket in data["shapes"].items():
            assert set(per_bucket) == {str(b) for b in BUCKETS}, key
            for entry in per_bucket.values():
                assert entry["choice"] in ("triton", "cublas"), key
                config = SkinnyConfig(*entry["config"])
                family = "one" if entry is per_bucket["1"] else "many"
                assert config in CANDIDATES[family], (key, config)


def test_step_sums_weigh_each_product_by_its_count_per_step() -> None:
    entries = {}
    for p in products("llama-3.2-1b"):
        entries[shape_key("bfloat16", p.n, p.k, p.gated)] = {
            str(b): {
                "choice": "triton" if p.name == "o" else "cublas",
                "triton_us": 1.0,
                "cublas_us": 2.0,
            }
            for b in BUCKETS
        }
    sums = step_sums("llama-3.2-1b", entries, "bfloat16")
    # 16 layers x 4 products + the LM head, 2 us each; the kernel saves 1 us on 16 of them.
    assert sums[0] == {"shape": "llama-3.2-1b", "rows": 1, "cublas_ms": 0.13, "chosen_ms": 0.114}


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_programmatic_dependent_launches_give_the_plain_launches_bits_in_a_graph(
    rows: int,
) -> None:
    """A chain of products, each reading the one before's output, an RMSNorm (which releases
    its dependent as it starts) before the gated one, captured with each launch mode: a
    dependent launch (`pdl` 1) loads weights early but waits for its input, so the bits are
    the same."""
    from srt.layers.triton_ops.rms_norm import rms_norm_into
    from srt.layers.triton_ops.skinny_matmul import skinny_matmul_into

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    config = SkinnyConfig(4, 256, 4, 2) if rows == 1 else SkinnyConfig(32, 128, 4, 3)
    sizes = [(768, 512), (2048, 768), (512, 1024), (768, 512)]  # (n, k); the third gated
    weights = [
        torch.randn(n, k, generator=gen, device=dev, dtype=torch.bfloat16) * k**-0.5
        for n, k in sizes
    ]
    x = torch.randn(rows, 512, generator=gen, device=dev, dtype=torch.bfloat16)
    outs = [
        torch.empty(rows, 1024 if i == 1 else n, device=dev, dtype=torch.bfloat16)
        for i, (n, _) in enumerate(sizes)
    ]

    normed = torch.empty(rows, 768, device=dev, dtype=torch.bfloat16)
    norm_weight = torch.rand(768, generator=gen, device=dev, dtype=torch.bfloat16) + 0.5

    def chain(pdl: int) -> None:
        current = x
        for i, (w, out) in enumerate(zip(weights, outs, strict=True)):
            if i == 1:
                rms_norm_into(normed, current, norm_weight, 1e-6)
                current = normed
            skinny_matmul_into(out, current, w, None, config, gated=i == 1, pdl=pdl)
            current = out

    results = []
    for pdl in (0, 1):
        chain(pdl)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain(pdl)
        for out in (*outs, normed):
            out.fill_(float("nan"))  # poisoned: the replay must write every element
        graph.replay()
        torch.cuda.synchronize()
        results.append([out.clone() for out in outs])
    for got in results[1:]:
        for a, b in zip(results[0], got, strict=True):
            assert torch.equal(a, b)
