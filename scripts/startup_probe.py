"""Where a server start's seconds go on this host: each piece timed in a fresh interpreter, so
that nothing is imported twice or served from this process's caches.

    python scripts/startup_probe.py [MODEL_DIR]

Prints one line per piece: `import torch`, the CUDA context and cuBLAS, `import triton`, the
model runner's own imports, the launcher's tokenizer (transformers' import and the load, and
whether torch came with it), Dynamo's and Inductor's imports, and a Triton kernel's first call
with an empty cache and then with a warm one. The CUDA pieces need a GPU.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def probe(label: str, code: str, runs: int = 1) -> None:
    """Run `code` in `runs` fresh interpreters; print the wall seconds of each and the last
    one's own output (the finer figures it measured itself)."""
    times, out = [], ""
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True
        )
        times.append(time.perf_counter() - start)
        if proc.returncode:
            print(f"{label}: failed: {proc.stderr.strip().splitlines()[-1:]}", flush=True)
            return
        out = proc.stdout.strip()
    print(f"{label:48s} {' '.join(f'{t:6.2f}' for t in times)} s   {out}", flush=True)


def main(model_dir: str | None) -> None:
    probe("python -c pass", "pass", 2)
    probe("import torch", "import torch", 3)
    probe(
        "import torch, CUDA context, cuBLAS, triton",
        "import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter()\n"
        "torch.zeros(1, device='cuda'); t2 = time.perf_counter()\n"
        "a = torch.ones(16, 16, device='cuda', dtype=torch.bfloat16); (a @ a).sum().item()\n"
        "t3 = time.perf_counter(); import triton; t4 = time.perf_counter()\n"
        "print(f'torch {t1 - t0:.2f} context {t2 - t1:.2f} cublas {t3 - t2:.2f} '\n"
        "      f'triton {t4 - t3:.2f}')",
    )
    probe(
        "the model runner's imports",
        "import time; t = time.perf_counter(); import torch; a = time.perf_counter()\n"
        "import srt.model_executor.model_runner\n"
        "print(f'torch {a - t:.2f} the rest {time.perf_counter() - a:.2f}')",
    )
    if model_dir:
        probe(
            "the launcher's tokenizer",
            "import sys, time; t = time.perf_counter()\n"
            "from srt.server.hf_tokenizer import load_tokenizer\n"
            f"load_tokenizer({model_dir!r})\n"
            "print(f'{time.perf_counter() - t:.2f} s, torch imported: {\"torch\" in sys.modules}')",
        )
    probe(
        "Dynamo's and Inductor's imports (after torch)",
        "import time; import torch; t = time.perf_counter(); import torch._dynamo\n"
        "a = time.perf_counter(); import torch._inductor.compile_fx\n"
        "print(f'dynamo {a - t:.2f} inductor {time.perf_counter() - a:.2f}')",
    )
    cache = tempfile.mkdtemp()
    probe(
        "a Triton kernel's first call (empty, then warm cache)",
        f"import os, time, torch; os.environ['TRITON_CACHE_DIR'] = {cache!r}\n"
        "from srt.layers.layernorm import rms_norm_kernel\n"
        "x = torch.randn(4, 2048, device='cuda', dtype=torch.bfloat16)\n"
        "w = torch.ones(2048, device='cuda', dtype=torch.bfloat16); torch.cuda.synchronize()\n"
        "t = time.perf_counter(); rms_norm_kernel(x, w, 1e-5); torch.cuda.synchronize()\n"
        "print(f'first call {time.perf_counter() - t:.3f} s')",
        2,
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
