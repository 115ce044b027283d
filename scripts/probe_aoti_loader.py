"""Whether AOTInductor's package loader runs on this machine: a two-op module exported and
compiled with torch's own API (`torch._inductor.aoti_compile_and_package`), then loaded in a
child process, once with torch's `load_package` and once with the C++ loader srt uses
(`torch._C._aoti.AOTIModelPackageLoader`); prints each child's exit status (negative: the
signal that killed it).

    python scripts/probe_aoti_loader.py [cuda|cpu]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

LOADS = {
    "load_package": "from torch._inductor.package import load_package\n"
    "print(load_package(path)(x, w)[0].shape)",
    "AOTIModelPackageLoader": "index = 0 if x.is_cuda else -1\n"
    "package = torch._C._aoti.AOTIModelPackageLoader(path, 'model', True, 1, index)\n"
    "print(package.run([x, w])[0].shape)",
}


class TwoOps(nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        return (nn.functional.silu(x @ w) * 2,)


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x, w = (
        torch.randn(5, 64, device=device, dtype=dtype),
        torch.randn(64, 32, device=device, dtype=dtype),
    )
    tokens = torch.export.Dim("tokens", min=1, max=8192)
    exported = torch.export.export(TwoOps(), (x, w), dynamic_shapes=({0: tokens}, None))
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "two_ops.pt2")
        torch._inductor.aoti_compile_and_package(exported, package_path=path)
        print(f"torch {torch.__version__}, {device}: compiled {path}")
        for name, load in LOADS.items():
            code = (
                f"import torch\npath = {path!r}\n"
                f"x = torch.randn(5, 64, device={device!r}, dtype={dtype})\n"
                f"w = torch.randn(64, 32, device={device!r}, dtype={dtype})\n{load}\n"
            )
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            last = (done.stdout.strip() or done.stderr.strip()).splitlines()[-1:] or [""]
            print(f"{name}: exit status {done.returncode}; {last[0][:300]}")


if __name__ == "__main__":
    main()
