"""Every Triton kernel srt launches compiles for the H200 (sm_90), on a machine without a GPU.

The CPU tests run the kernels under Triton's interpreter, which accepts code the compiler
refuses (a module global that is not a `tl.constexpr`, for one). So, in a subprocess with the
interpreter on, each kernel is launched through its srt wrapper on small inputs with the launch
itself replaced by a recorder (nothing runs: only the argument types are wanted), and each
distinct launch is compiled to a cubin with Triton's own compiler and ptxas (both ship in the
triton wheel; no driver is needed).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
H200 = ("cuda", 90, 32)  # backend, compute capability, warp size

_POINTER_TYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.bool: "i1",
}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


def _scalar_type(value: Any) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for argument {value!r}")


def launch_signature(fn: Any, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """(signature, constexprs, options) of one launch of JIT function `fn`, as keys to compile."""
    from triton.runtime.jit import JITFunction

    params = JITFunction(fn).params
    options = {k: kwargs.pop(k) for k in _LAUNCH_OPTIONS if k in kwargs}
    bound = dict(zip([p.name for p in params], args, strict=False)) | kwargs
    signature, constexprs = {}, {}
    for p in params:
        value = bound[p.name] if p.name in bound else p.default
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[p.name] = "*" + _POINTER_TYPES[value.dtype]
        else:
            signature[p.name] = _scalar_type(value)
    return (
        tuple(signature.items()),
        tuple(sorted(constexprs.items())),
        tuple(sorted(options.items())),
    )


def record_launches() -> dict[str, list[tuple]]:
    """Launch srt's kernels through their wrappers, recording instead of running: per kernel
    (by qualified name), its distinct launch signatures (fp16 data; the compile step adds the
    bf16 twin)."""
    from triton.runtime.interpreter import InterpretedFunction

    launches: dict[str, set[tuple]] = {}
    original = InterpretedFunction.run

    def run(self: Any, *args: Any, **kwargs: Any) -> None:
        launch = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
        name = f"{self.fn.__module__}.{self.fn.__name__}"
        launches.setdefault(name, set()).add(launch_signature(self.fn, args, launch))

    InterpretedFunction.run = run  # type: ignore[method-assign]
    try:
        exercise_kernels()
    finally:
        InterpretedFunction.run = original  # type: ignore[method-assign]
    return {name: sorted(sigs, key=repr) for name, sigs in launches.items()}


def exercise_kernels() -> None:
    """Every kernel's launch, through the wrappers the model calls (results unused)."""
    from srt.batch_layout import ForwardMode
    from srt.layers.attention.base import AttentionInputs
    from srt.layers.attention.triton_backend import TritonBackend
    from srt.layers.attention.triton_ops.kv_indices import kv_indices
    from srt.layers.attention.triton_ops.kv_write import rotary_write_kv, write_kv
    from srt.layers.triton_ops.argmax import argmax_rows
    from tests.layer_op_cases import op_cases, skinny_cases_table
    from tests.test_attention_backends import World, make_batch

    torch.manual_seed(0)
    with skinny_cases_table("cpu"):
        for kernel_op, _, args in op_cases(torch.float16, "cpu"):
            kernel_op(*args)
    argmax_rows(torch.randn(3, 5000))
    cache = torch.zeros(10, 2, 24, dtype=torch.float16)
    write_kv(cache, cache.clone(), torch.tensor([3, 5]), *torch.randn(2, 2, 2, 24).half())
    q, k, v = torch.randn(2, 6 * 24).half(), torch.randn(2, 2 * 24).half(), torch.randn(2, 48)
    tables = torch.randn(2, 32, 12)
    rotary_write_kv(
        cache, cache.clone(), torch.tensor([3, 5]), torch.tensor([0, 7]), q, k, v.half(), *tables
    )
    # FlashInfer's pages: a table of int32 slots, rows and offsets int32 (as the backend has them).
    table = torch.arange(40, dtype=torch.int32).reshape(4, 10)
    indptr = torch.tensor([0, 3, 10], dtype=torch.int32)
    kv_indices(
        table,
        torch.tensor([2, 0], dtype=torch.int32),
        indptr,
        torch.empty(10, dtype=torch.int32),
        7,
    )
    heads, kv_heads, head_dim = 8, 2, 64
    world = World.create(kv_heads, head_dim, torch.float16, "cpu")
    backend = TritonBackend(heads, kv_heads, head_dim)
    for mode, specs in [(ForwardMode.EXTEND, [(0, 3), (60, 9)]), (ForwardMode.DECODE, [(9, 1)])]:
        batch, q, k, v = make_batch(world, mode, specs, heads)
        backend.init_forward_metadata(batch)
        out = torch.empty_like(q)
        backend.forward(
            batch, AttentionInputs(q, k, v, out, world.k_cache, world.v_cache, head_dim**-0.5)
        )


def compile_for_h200(launches: dict[str, list[list]]) -> list[str]:
    """Compile every recorded launch, and its bf16 twin, to a cubin (in a process without the
    interpreter, where the kernels are the compiler's `JITFunction`s); the failures."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failures = []
    for name, sigs in launches.items():
        module, _, attr = name.rpartition(".")
        kernel = getattr(importlib.import_module(module), attr)
        variants = {
            (tuple(map(tuple, sig)), tuple(map(tuple, consts)), tuple(map(tuple, opts)), half)
            for sig, consts, opts in sigs
            for half in ("fp16", "bf16")
        }
        for sig, consts, opts, half in sorted(variants, key=repr):
            signature = {k: v.replace("fp16", half) for k, v in sig}
            source = ASTSource(kernel, signature, constexprs=dict(consts))
            try:
                compiled = triton.compile(source, target=GPUTarget(*H200), options=dict(opts))
                assert compiled.asm.get("cubin"), "no cubin"
            except Exception as e:  # noqa: BLE001 (each failure is reported with its launch)
                failures.append(f"{name} {signature} {dict(consts)}: {type(e).__name__}: {e}")
    return failures


def main(step: str) -> None:
    """`record`: print the launches as JSON (interpreter on); `compile`: compile the JSON on
    stdin (interpreter off), exiting non-zero with the failures."""
    if step == "record":
        print(json.dumps(record_launches()))
        return
    failures = compile_for_h200(json.load(sys.stdin))
    if failures:
        sys.exit("\n".join(failures))


def run_python(code: str, interpret: bool, stdin: str = "", timeout: float = 600) -> str:
    """Run `code` in a fresh Python process at the checkout, with Triton's interpreter on or
    off (an interpreted launch patches `triton.language` for good in its process, after which
    the compiler cannot build a kernel there); its stdout, after asserting it succeeded."""
    # The checkout first, then what the caller's path had (a host's extra site directory).
    path = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{code}: {(proc.stdout + proc.stderr)[-6000:]}"
    return proc.stdout


def run_step(step: str, interpret: bool, stdin: str = "") -> str:
    code = f"from tests.test_triton_compile import main; main({step!r})"
    return run_python(code, interpret, stdin)


def test_every_triton_kernel_compiles_for_the_h200() -> None:
    pytest.importorskip("triton")
    launches = run_step("record", interpret=True)
    run_step("compile", interpret=False, stdin=launches)
    # Every kernel srt defines was launched above (a new kernel needs a launch there).
    defined = {
        f"{'.'.join(p.relative_to(REPO).with_suffix('').parts)}.{m.group(1)}"
        for p in (REPO / "srt").rglob("*.py")
        for m in re.finditer(r"@triton\.jit(?:\([^)]*\))?\ndef (\w+_kernel)\(", p.read_text())
    }
    assert defined, "no kernels found"
    never = defined - set(json.loads(launches))
    assert not never, f"never launched: {sorted(never)}"


_PDL_PTX = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from srt.layers.triton_ops.skinny_matmul import _skinny_matmul_kernel as kernel
pointers = {name: "*bf16" for name in ("X", "W", "BIAS", "RES", "OUT")}
scalars = {name: "i32"
           for name in ("M", "N", "stride_xm", "stride_wn", "stride_rm", "stride_om", "up_offset")}
scalars["rms_eps"] = "fp32"
for pdl in (0, 1):
    # one K block (the release after the wait), two (in the loop's last turn), and eight
    for rows, gated, block_k in ((1, True, 2048), (1, False, 1024), (16, False, 256)):
        consts = dict(K=2048, HAS_BIAS=False, HAS_RESIDUAL=False, RMS_NORM=False, GATED=gated,
                      EVEN_K=True, BLOCK_M=rows,
                      BLOCK_N=4 if rows == 1 else 32, BLOCK_K=block_k,
                      PRECISION="tf32", UPCAST_DOT=False, PDL=pdl > 0)
        signature = pointers | scalars | {name: "constexpr" for name in consts}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=consts),
                                  target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=4, num_stages=2, launch_pdl=pdl > 0))
        ptx = compiled.asm["ptx"]
        # The weight tile loads before the wait: some global load precedes it in the PTX.
        before_wait = ptx.split("griddepcontrol.wait")[0]
        print(pdl, block_k, "griddepcontrol.wait" in ptx,
              "griddepcontrol.launch_dependents" in ptx,
              "ld.global" in before_wait and "griddepcontrol.wait" in ptx,
              compiled.metadata.launch_pdl)
"""


def test_the_skinny_kernel_compiles_as_a_programmatic_dependent_for_the_h200() -> None:
    """`pdl=1` waits for the kernel before in `griddepcontrol.wait` (at one row after loading
    its first weight tile), lets the next one start (`launch_dependents`) and is launched with
    the attribute; a plain launch has neither instruction."""
    pytest.importorskip("triton")
    lines = run_python(_PDL_PTX, interpret=False).split()
    got = [lines[i : i + 6] for i in range(0, len(lines), 6)]
    assert got == [
        ["0", "2048", "False", "False", "False", "False"],
        ["0", "1024", "False", "False", "False", "False"],
        ["0", "256", "False", "False", "False", "False"],
        ["1", "2048", "True", "True", "True", "True"],
        ["1", "1024", "True", "True", "True", "True"],
        ["1", "256", "True", "True", "False", "True"],
    ]


_PDL_SHARED = """
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from srt.layers.skinny_matmul_table import TUNED_DIR
from srt.layers.triton_ops.skinny_matmul import MAX_ROWS, _skinny_matmul_kernel as kernel
params = list(inspect.signature(kernel.fn).parameters)
signature = {name: "*bf16" for name in ("X", "W", "BIAS", "RES", "OUT")}
signature |= {name: "i32" for name in
              ("M", "N", "stride_xm", "stride_wn", "stride_rm", "stride_om", "up_offset")}
signature["rms_eps"] = "fp32"
# What a launch on the GPU is specialised on (pointers and strides divisible by 16): with it the
# tensor-core path's loads go through shared memory, as they do there.
attrs = {(params.index(name),): [["tt.divisibility", 16]]
         for name in ("X", "W", "BIAS", "RES", "OUT", "N", "stride_xm", "stride_wn", "stride_rm",
                      "stride_om")}
launches = set()
for table in sorted(TUNED_DIR.glob("skinny_matmul-*.json")):
    for key, buckets in json.loads(table.read_text())["shapes"].items():
        k = int(key.split()[1].split("x")[1])
        for rows, entry in buckets.items():
            if "config" in entry:  # one row (dot products), or the tensor cores' 2-16
                launches.add((1 if rows == "1" else MAX_ROWS, k, key.endswith("gated"),
                              *entry["config"]))
for block_m, k, gated, block_n, block_k, warps, stages in sorted(launches):
    shared = []
    # plainly; as a dependent; and in the model's forms where the norms are in the products:
    # the residual added (o_proj, down_proj) and, at one row, the input normalised (QKV,
    # gate/up), plain and dependent
    forms = [(False, False, False), (True, False, False)]
    forms += [(pdl, False, True) for pdl in (False, True)] if not gated else []
    forms += [(pdl, True, False) for pdl in (False, True)] if block_m == 1 else []
    for pdl, rms_norm, residual in forms:
        consts = dict(K=k, HAS_BIAS=False, HAS_RESIDUAL=residual, RMS_NORM=rms_norm, GATED=gated,
                      EVEN_K=k % block_k == 0, BLOCK_M=block_m, BLOCK_N=block_n,
                      BLOCK_K=block_k, PRECISION="tf32", UPCAST_DOT=False, PDL=pdl)
        compiled = triton.compile(
            ASTSource(kernel, signature | {name: "constexpr" for name in consts},
                      constexprs=consts, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=warps, num_stages=stages, launch_pdl=pdl))
        shared.append(compiled.metadata.shared)
    print(json.dumps([[block_m, k, gated, block_n, block_k, warps, stages], *shared]))
"""


def test_no_form_of_a_launch_takes_more_shared_memory_than_the_plain_one() -> None:
    """Every launch the committed tables choose compiles for sm_90 in each form the model
    makes, and needs no more shared memory as a dependent launch, or with the residual add or
    (at one row) the norm in it, than it does plainly (the tables were tuned plainly, against
    the SM's limit): r39's first form of the dependent launch took a stage more, and the LM
    head's tile no longer fit an H100."""
    pytest.importorskip("triton")
    rows = [json.loads(line) for line in run_python(_PDL_SHARED, interpret=False).splitlines()]
    assert {r[0][0] for r in rows} == {1, 16}, "no launch of each path in the committed tables"
    assert [r for r in rows if max(r[2:]) > r[1]] == []


_RELEASE_PTX = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from srt.layers.attention.triton_ops.decode_attention import _decode_kernel
from srt.layers.triton_ops.rms_norm import _rms_norm_kernel
norm = dict(X="*bf16", W="*bf16", OUT="*bf16", RES="*bf16", RES_OUT="*bf16", num_heads="i32",
            stride_x_token="i32", stride_x_head="i32", stride_res_token="i32", n_cols="i32",
            eps="fp32")
decode = {name: "*bf16" for name in ("Q", "K", "V", "Out")}
decode |= {name: "*i32" for name in ("req_to_token", "req_pool_indices", "seq_lens", "arrivals")}
decode |= {name: "*fp32" for name in ("part_out", "part_lse")}
decode |= {name: "i32" for name in (
    "stride_q_tok", "stride_q_head", "stride_o_tok", "stride_o_head", "stride_k_slot",
    "stride_k_head", "stride_v_slot", "stride_v_head", "stride_table", "stride_po_req",
    "stride_po_head", "stride_po_split", "stride_pl_req", "stride_pl_head", "num_splits",
    "min_split")} | {"scale_log2": "fp32"}
kernels = (
    (_rms_norm_kernel, norm, dict(HAS_RESIDUAL=True, BLOCK=2048), 8),
    (_decode_kernel, decode, dict(GROUP=4, HEAD_DIM=64, BLOCK_D=64, BLOCK_H=16, BLOCK_G=4,
                                  BLOCK_N=64, DOT_PRECISION="tf32", LOAD_V_WITH_K=True), 2),
)
for kernel, signature, consts, warps in kernels:
    for release in (False, True):
        c = consts | {"RELEASE_DEPENDENTS": release}
        compiled = triton.compile(
            ASTSource(kernel, signature | {name: "constexpr" for name in c}, constexprs=c),
            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=2))
        print(release, "griddepcontrol.launch_dependents" in compiled.asm["ptx"])
"""


def test_the_norm_and_decode_attention_kernels_release_their_dependents_on_the_h200() -> None:
    """With RELEASE_DEPENDENTS (a CUDA tensor on sm_90: `releases_dependents`) the RMSNorm and
    decode attention kernels call `launch_dependents`; without it, they do not."""
    pytest.importorskip("triton")
    lines = run_python(_RELEASE_PTX, interpret=False).split()
    # (RELEASE_DEPENDENTS, launch_dependents in the PTX): the norm's two, then attention's
    assert lines == ["False", "False", "True", "True"] * 2
