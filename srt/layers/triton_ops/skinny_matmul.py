"""Matrix products of a few rows (a decode step's batch) against a weight streamed once.

`out[M, N] = x[M, K] @ w[N, K]^T (+ bias)` for M up to `MAX_ROWS`: the step reads every weight
once, so its time is the weight's bytes over the bandwidth the kernel reaches, and a kernel
made for this shape can reach more of it than a general GEMM library's small-batch path. Each
program owns `BLOCK_N` output columns (weight rows) and walks all of K: no split-K, so no
partials and no reduce launch. One row (`BLOCK_M == 1`) is a dot product per column on the
CUDA cores; more rows go through the tensor cores with the product transposed (the weight
rows fill the MMA's long side, the batch padded to 16 its short one).

`GATED` fuses the SiLU-and-mul of a packed gate/up projection into the epilogue: a program
computes columns j of the gate and j of the up half together and writes silu(gate) * up,
rounded as the unfused reference rounds (the product in the activation dtype, then the
activation), so the fused and the unfused paths differ only in the sums' order.

The weights are loaded with `evict_first`: they are read once per step and should not push
the activations out of L2.

`pdl` launches the kernel as a programmatic dependent of the one before it (sm_90): its
programs may start while that kernel ends and wait in `gdc_wait` before touching an
activation, and the next grid may start once this one's loop is done; `pdl=2` also prefetches
the program's first weight tiles into L2 before waiting (the weights are no kernel's output).
Off by default (`--skinny-matmul-launch`): r28-r30 measured 1-4% off a chain of these
products alone, nothing off the step (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from srt.layers.skinny_matmul_table import MAX_ROWS, SkinnyConfig


@triton.jit
def _prefetch_l2(row_ptrs, row_bytes):
    """cp.async.bulk.prefetch.L2 of `row_bytes` from each pointer (sm_90): into L2, no registers."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r",
        [row_ptrs, row_bytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


# One compile for every row count above 1 (Triton would specialise 16 apart from 2 to 15).
@triton.jit(do_not_specialize=["M", "up_offset"])
def _skinny_matmul_kernel(
    X,
    W,
    BIAS,
    OUT,
    M,
    N,
    K: tl.constexpr,  # a model has a few; and Triton's interpreter cannot loop to a runtime bound
    stride_xm,
    stride_wn,
    stride_om,
    up_offset,  # GATED: weight rows from a gate row to its up row
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_L2: tl.constexpr,
    PREFETCH_K: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    # A masked column reads row 0, so that every weight load is in bounds and unmasked on N.
    safe_cols = tl.where(col_mask, cols, 0).to(tl.int64)
    if PDL:
        # Launched as a programmatic dependent: this grid may start while the kernel before it
        # ends. Nothing a kernel before wrote is read, nor anything written, before gdc_wait.
        if PREFETCH_L2:
            # The weights are no kernel's output: the program's first tiles (what the loop's
            # stages load first) start into L2 now. Only those: a whole matrix can exceed L2,
            # and would then be read from memory twice.
            row_bytes = tl.full(
                [BLOCK_N], PREFETCH_K * W.dtype.element_ty.primitive_bitwidth // 8, tl.int32
            )
            _prefetch_l2(W + safe_cols * stride_wn, row_bytes)
            if GATED:
                _prefetch_l2(W + (safe_cols + up_offset) * stride_wn, row_bytes)
        tl.extra.cuda.gdc_wait()
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = W + safe_cols[:, None] * stride_wn + ks[None, :]
    up_ptrs = w_ptrs + up_offset * stride_wn
    x_ptrs = X + rows[None, :] * stride_xm + ks[:, None]  # x^T: [BLOCK_K, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=row_mask[None, :], other=0.0)
            if GATED:
                w_up = tl.load(up_ptrs, eviction_policy="evict_first")
        else:
            k_mask = ks < K - k
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=row_mask[None, :] & k_mask[:, None], other=0.0)
            if GATED:
                w_up = tl.load(
                    up_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first"
                )
        if BLOCK_M == 1:
            # [BLOCK_N, BLOCK_K] * [1, BLOCK_K], summed over K: one row needs no MMA.
            x_row = tl.trans(x).to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * x_row, axis=1, keep_dims=True)
            if GATED:
                acc_up += tl.sum(w_up.to(tl.float32) * x_row, axis=1, keep_dims=True)
        else:
            if UPCAST_DOT:
                w = w.to(tl.float32)
                x = x.to(tl.float32)
                if GATED:
                    w_up = w_up.to(tl.float32)
            acc += tl.dot(w, x, input_precision=PRECISION)
            if GATED:
                acc_up += tl.dot(w_up, x, input_precision=PRECISION)
        w_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if PDL:
        # The weights are read: let the next kernel's grid start (it waits for this whole grid
        # in its gdc_wait). Not earlier: its waiting programs would hold SMs this grid's later
        # waves need (r28: triggered at the start, 16 rows of the 1B products took 1.20x).
        tl.extra.cuda.gdc_launch_dependents()
    dtype = OUT.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(BIAS + safe_cols).to(tl.float32)[:, None]
    if GATED:
        # The unfused path's roundings: the projection's output, the activation, the product.
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        result = (act * up).to(dtype)
    else:
        result = acc.to(dtype)
    out_ptrs = OUT + rows[None, :] * stride_om + cols[:, None]
    tl.store(out_ptrs, result, mask=row_mask[None, :] & col_mask[:, None])


def skinny_matmul_into(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: SkinnyConfig,
    gated: bool = False,
    pdl: int = 0,
) -> None:
    """out = x @ weight^T (+ bias) or, `gated`, silu(x @ gate^T) * (x @ up^T) for weight the
    packed [gate; up] (no bias). x [M, K] with M <= MAX_ROWS and unit stride on K, weight
    [N, K] contiguous, out [M, N] (N / 2 gated) with unit stride on N. `pdl`: 0 a plain launch,
    1 a programmatic dependent launch, 2 that and the weights prefetched into L2 (CUDA only)."""
    rows, k = x.shape
    if not 0 < rows <= MAX_ROWS:
        raise ValueError(f"skinny_matmul_into takes 1 to {MAX_ROWS} rows, got {rows}")
    if pdl and x.device.type != "cuda":
        raise ValueError("skinny_matmul_into: pdl (programmatic dependent launch) needs CUDA")
    if x.stride(-1) != 1:
        x = x.contiguous()
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    assert weight.stride(-1) == 1 and out.stride(-1) == 1 and out.shape == (rows, n)
    assert not (gated and bias is not None)
    prefetch_bytes = min(k, config.block_k * config.num_stages) * weight.element_size()
    # A bulk prefetch moves whole 16-byte units from a 16-byte aligned address: a weight whose
    # rows do not start on one, or a prefix that does not end on one, is launched as a
    # dependent only.
    row_stride = weight.stride(0) * weight.element_size()
    prefetch = pdl > 1 and (weight.data_ptr() | row_stride | prefetch_bytes) % 16 == 0
    _skinny_matmul_kernel[(triton.cdiv(n, config.block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        n if gated else 0,
        HAS_BIAS=bias is not None,
        GATED=gated,
        EVEN_K=k % config.block_k == 0,
        BLOCK_M=1 if rows == 1 else MAX_ROWS,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        # float32 as the reference computes it (cuBLAS does not round to TF32 by default).
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        # Only Triton's interpreter runs CPU tensors, and its tl.dot multiplies the bit
        # patterns of 16-bit floats (it stores them as integers): products of float32 upcasts
        # are the same products, exactly.
        UPCAST_DOT=x.device.type == "cpu",
        PDL=pdl > 0,
        PREFETCH_L2=prefetch,
        PREFETCH_K=min(k, config.block_k * config.num_stages),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        launch_pdl=pdl > 0,
    )
