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

`RMS_NORM` (one row) normalises x before the product, where the norm's weight was folded
into the product's weight: each program sums the squares of the activation tiles it loads
for the product and scales its sums by the row's rsqrt after the loop, so the norm costs no
launch and no read of its own. `HAS_RESIDUAL` adds the residual stream to the output in the
epilogue (o_proj's and down_proj's), which the norm kernel did before.

The weights are loaded with `evict_first`: they are read once per step and should not push
the activations out of L2.

`pdl` launches the kernel as a programmatic dependent of the kernel before it (sm_90): its
programs may start while that kernel still runs (the step's RMSNorm and decode attention
kernels release their dependents as they start, `dependent_launch.py`), at one row load their
first weight tile (the weights are no kernel's output), and wait in `gdc_wait` before they
read the activation; each program releases the next grid as it reaches its last K block. Off
by default (`--skinny-matmul-launch`); the op asks for it at one row only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from srt.layers.skinny_matmul_table import MAX_ROWS, SkinnyConfig


@triton.jit
def _load_weight_tile(w_ptrs, up_ptrs, ks, k_left, EVEN_K: tl.constexpr, GATED: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at `w_ptrs` (and its up rows', GATED), `k_left`
    columns of it in bounds."""
    if EVEN_K:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
        w_up = tl.load(up_ptrs, eviction_policy="evict_first") if GATED else w
    else:
        k_mask = (ks < k_left)[None, :]
        w = tl.load(w_ptrs, mask=k_mask, other=0.0, eviction_policy="evict_first")
        if GATED:
            w_up = tl.load(up_ptrs, mask=k_mask, other=0.0, eviction_policy="evict_first")
        else:
            w_up = w
    return w, w_up


@triton.jit
def _load_x_tile(x_ptrs, ks, k_left, row_mask, EVEN_K: tl.constexpr):
    """The activation's [BLOCK_K, BLOCK_M] tile (x^T) at `x_ptrs`."""
    if EVEN_K:
        return tl.load(x_ptrs, mask=row_mask[None, :], other=0.0)
    return tl.load(x_ptrs, mask=row_mask[None, :] & (ks < k_left)[:, None], other=0.0)


@triton.jit
def _accumulate(
    acc,
    acc_up,
    squares,
    w,
    w_up,
    x,
    GATED: tl.constexpr,
    RMS_NORM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    if RMS_NORM:
        # The row's squares, summed after the loop for the norm's scale: the tile is loaded
        # for the product anyway, so the statistic costs a multiply-add per element. Summed
        # across the threads once, after the loop, not per K block (r40: with a reduction
        # per block, which synchronises the threads in the loop, the 8B products took 0.23
        # ms more a step).
        x32 = x.to(tl.float32)
        squares += x32 * x32
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
            w_up = w_up.to(tl.float32)
        acc += tl.dot(w, x, input_precision=PRECISION)
        if GATED:
            acc_up += tl.dot(w_up, x, input_precision=PRECISION)
    return acc, acc_up, squares


# One compile for every row count above 1 (Triton would specialise 16 apart from 2 to 15).
@triton.jit(do_not_specialize=["M", "up_offset"])
def _skinny_matmul_kernel(
    X,
    W,
    BIAS,
    RES,
    OUT,
    M,
    N,
    K: tl.constexpr,  # a model has a few; and Triton's interpreter cannot loop to a runtime bound
    stride_xm,
    stride_wn,
    stride_rm,
    stride_om,
    up_offset,  # GATED: weight rows from a gate row to its up row
    rms_eps,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    RMS_NORM: tl.constexpr,
    GATED: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    # A masked column reads row 0, so that every weight load is in bounds and unmasked on N.
    safe_cols = tl.where(col_mask, cols, 0).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = W + safe_cols[:, None] * stride_wn + ks[None, :]
    up_ptrs = w_ptrs + up_offset * stride_wn
    x_ptrs = X + rows[None, :] * stride_xm + ks[:, None]  # x^T: [BLOCK_K, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # The norm's statistic at one row only: the op normalises more rows with the norm kernel
    # first (`linear.kernel_input`).
    tl.static_assert(not RMS_NORM or BLOCK_M == 1)
    squares = tl.zeros((BLOCK_K, BLOCK_M) if RMS_NORM else (1, 1), dtype=tl.float32)
    # Launched as a programmatic dependent, this grid may run while the kernel before it does.
    # Nothing a kernel before wrote (the activation) is read, nor anything written, before
    # gdc_wait. The weights are no kernel's output: at one row the first K block's tile loads
    # first. Not on the tensor-core path, whose loop stages its loads through shared memory:
    # there a tile loaded before the loop took one stage's buffer more (r39: the LM head's
    # 64x256 tile at 5 stages needed 240 KB, past the H100's 227, and its warm-up failed).
    PEEL: tl.constexpr = PDL and BLOCK_M == 1
    if PDL and not PEEL:
        tl.extra.cuda.gdc_wait()
    if PEEL:
        w, w_up = _load_weight_tile(w_ptrs, up_ptrs, ks, K, EVEN_K, GATED)
        tl.extra.cuda.gdc_wait()
        if K <= BLOCK_K:
            tl.extra.cuda.gdc_launch_dependents()
        x = _load_x_tile(x_ptrs, ks, K, row_mask, EVEN_K)
        acc, acc_up, squares = _accumulate(
            acc, acc_up, squares, w, w_up, x, GATED, RMS_NORM, BLOCK_M, PRECISION, UPCAST_DOT
        )
        w_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    # Every K block here but a peeled first one.
    for k in range(BLOCK_K if PEEL else 0, K, BLOCK_K):
        w, w_up = _load_weight_tile(w_ptrs, up_ptrs, ks, K - k, EVEN_K, GATED)
        x = _load_x_tile(x_ptrs, ks, K - k, row_mask, EVEN_K)
        if PDL:
            if k + BLOCK_K >= K:
                # The last block's loads are out: let the next kernel's grid start (it waits
                # for this whole grid in its gdc_wait). Every program of this grid has started
                # by then, so a waiting dependent takes no SM this grid still needs (r28:
                # released at each program's start, 16 rows of the 1B products took 1.20x).
                tl.extra.cuda.gdc_launch_dependents()
        acc, acc_up, squares = _accumulate(
            acc, acc_up, squares, w, w_up, x, GATED, RMS_NORM, BLOCK_M, PRECISION, UPCAST_DOT
        )
        w_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    dtype = OUT.dtype.element_ty
    if RMS_NORM:
        # The product of the normalised rows is the product of the rows, scaled: the norm's
        # weight is folded into this product's weight (LlamaForCausalLM.fold_norm_weights).
        scale = tl.rsqrt(tl.sum(squares, axis=0, keep_dims=True) / K + rms_eps)
        acc *= scale
        if GATED:
            acc_up *= scale
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
    out_mask = row_mask[None, :] & col_mask[:, None]
    if HAS_RESIDUAL:
        # The residual add after the product, rounded as the unfused add is (the product in
        # the output dtype, then the sum).
        residual = tl.load(RES + rows[None, :] * stride_rm + cols[:, None], mask=out_mask)
        result = (result.to(tl.float32) + residual.to(tl.float32)).to(dtype)
    out_ptrs = OUT + rows[None, :] * stride_om + cols[:, None]
    tl.store(out_ptrs, result, mask=out_mask)


def skinny_matmul_into(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: SkinnyConfig,
    gated: bool = False,
    pdl: int = 0,
    residual: torch.Tensor | None = None,
    rms_eps: float | None = None,
) -> None:
    """out = x @ weight^T (+ bias) or, `gated`, silu(x @ gate^T) * (x @ up^T) for weight the
    packed [gate; up] (no bias). With `rms_eps` (one row), x is RMS-normalised first (no norm
    weight: a norm's weight is folded into `weight`); with `residual` (not gated), it is added
    to the result. x [M, K] with M <= MAX_ROWS and unit stride on K, weight [N, K] contiguous,
    out and residual [M, N] (N / 2 gated) with unit stride on N. `pdl`: 0 a plain launch, 1 a
    programmatic dependent launch (CUDA only)."""
    rows, k = x.shape
    if not 0 < rows <= MAX_ROWS:
        raise ValueError(f"skinny_matmul_into takes 1 to {MAX_ROWS} rows, got {rows}")
    if pdl and x.device.type != "cuda":
        raise ValueError("skinny_matmul_into: pdl (programmatic dependent launch) needs CUDA")
    if x.stride(-1) != 1:
        x = x.contiguous()
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    assert weight.stride(-1) == 1 and out.stride(-1) == 1 and out.shape == (rows, n)
    assert not (gated and (bias is not None or residual is not None))
    if rms_eps is not None and rows > 1:
        raise ValueError("skinny_matmul_into normalises one row; norm more first (kernel_input)")
    if residual is not None:
        assert residual.shape == out.shape
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    _skinny_matmul_kernel[(triton.cdiv(n, config.block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        residual if residual is not None else out,
        out,
        rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        n if gated else 0,
        rms_eps if rms_eps is not None else 0.0,
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        RMS_NORM=rms_eps is not None,
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
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        launch_pdl=pdl > 0,
    )
