"""How long each of srt's Triton kernels takes to compile for the H200 (sm_90), stage by
stage, on this machine's CPU (no GPU needed): what a first start's compile-ahead block waits
for is its longest compile.

    PYTHONPATH=<checkout> python3 scripts/time_triton_compile.py [--dtype bf16] [--json]

Every launch srt's wrappers make on the CPU tests' small inputs is recorded (as the compile
test records them: `tests.test_triton_compile`), then compiled once each into an empty disk
cache, in one process with the interpreter off, after one compile that pays Triton's set-up.
Prints, longest first: the kernel, its constexprs, the seconds in all, Triton's front end
(the Python AST to its IR) and each stage (`ttir`, `ttgir`, `llir`, `ptx`, `cubin`: ptxas),
and the PTX's size. The 1B and 8B decode attention kernels are added at their shapes' heads
(the tests' heads are smaller).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's tests helpers
from tests.test_triton_compile import H200, run_python, run_step  # noqa: E402

# The decode kernel's head constexprs at the served shapes (8 KV heads, 32 query heads).
SHAPE_HEADS = {"1B": 64, "8B": 128}


def compile_timed(launches: dict, dtype: str) -> list[dict]:
    """In a process with the interpreter off: each recorded launch compiled, timed by stage."""
    import importlib
    import os

    import triton
    import triton.compiler.compiler as compiler
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget(*H200)
    backend = compiler.make_backend(target)
    stage_s: dict[str, float] = {}
    add_stages = backend.add_stages

    def timed_stages(stages: dict, options: object, language: object) -> None:
        add_stages(stages, options, language)
        for name, stage in list(stages.items()):

            def run(src: object, metadata: dict, stage=stage, name=name) -> object:
                start = time.perf_counter()
                out = stage(src, metadata)
                stage_s[name] = time.perf_counter() - start
                return out

            stages[name] = run

    backend.add_stages = timed_stages
    compiler.make_backend = lambda _target: backend
    rows = []
    for index, (name, sig, consts, opts) in enumerate(launches):
        module, _, attr = name.rpartition(".")
        kernel = getattr(importlib.import_module(module), attr)
        signature = {k: v.replace("fp16", dtype) for k, v in sig}
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="srt-compile-timing-")
        stage_s.clear()
        start = time.perf_counter()
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs=dict(consts)),
            target=target,
            options=dict(opts),
        )
        seconds = time.perf_counter() - start
        if index == 0:
            continue  # Triton's set-up (its backend, LLVM) rides on the first compile
        rows.append(
            {
                "kernel": attr,
                "constexprs": dict(consts),
                "seconds": round(seconds, 3),
                "front_end": round(seconds - sum(stage_s.values()), 3),
                **{k: round(v, 3) for k, v in stage_s.items()},
                "ptx_kb": round(len(compiled.asm["ptx"]) / 1000, 1),
            }
        )
    return sorted(rows, key=lambda r: -r["seconds"])


def with_shapes(launches: dict) -> list:
    """The recorded launches as (name, signature, constexprs, options), the first repeated as
    the set-up compile, and the decode kernel's at each served shape's heads."""
    flat = [
        (name, sig, consts, opts) for name, sigs in launches.items() for sig, consts, opts in sigs
    ]
    decode = [launch for launch in flat if launch[0].endswith("._decode_kernel")]
    for head_dim in SHAPE_HEADS.values():
        for name, sig, consts, opts in decode[:1]:
            heads = dict(consts) | {
                "GROUP": 4,
                "HEAD_DIM": head_dim,
                "BLOCK_D": head_dim,
                "BLOCK_H": 16,
                "BLOCK_G": 4,
            }
            launch = (name, sig, sorted(heads.items()), opts)
            if all(launch[:3] != (n, s, sorted(map(tuple, c))) for n, s, c, _ in flat):
                flat.append(launch)
    return flat[:1] + flat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--json", action="store_true", help="Print the rows as JSON lines.")
    ns = parser.parse_args()
    launches = with_shapes(json.loads(run_step("record", interpret=True)))
    code = (
        "import json, sys; sys.path.insert(0, 'scripts'); "
        "from time_triton_compile import compile_timed; "
        f"print(json.dumps(compile_timed(json.load(sys.stdin), {ns.dtype!r})))"
    )
    rows = json.loads(run_python(code, interpret=False, stdin=json.dumps(launches)))
    for row in rows:
        if ns.json:
            print(json.dumps(row))
            continue
        stages = " ".join(f"{k} {row[k]:.3f}" for k in ("ttir", "ttgir", "llir", "ptx", "cubin"))
        consts = ", ".join(f"{k}={v}" for k, v in row["constexprs"].items())
        print(
            f"{row['seconds']:6.3f} s  {row['kernel']}  front end {row['front_end']:.3f} {stages}"
            f"  ptx {row['ptx_kb']} kB  ({consts})"
        )


if __name__ == "__main__":
    main()
