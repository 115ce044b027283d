"""Whether AOTInductor's package loader runs on this machine, and if not, where it dies: a
two-op module exported and compiled with torch's own API
(`torch._inductor.aoti_compile_and_package`), then loaded in child processes, each one way:

- `load_package`: torch's Python loader;
- `AOTIModelPackageLoader`: the C++ loader srt uses (`torch._C._aoti`), after CUDA is made
  ready (as srt's start does), before it (`..., no CUDA first`), and with CUDA's modules loaded
  eagerly (`CUDA_MODULE_LOADING=EAGER`);
- `container by ctypes`: the package's model library opened with ctypes and driven through
  its C interface (create the container, run it on the current stream, delete it), which
  leaves torch's loader and its runner classes out: a step-by-step log says which step a
  crash was in, the library's or torch's.

Each child runs with Python's fault handler on; the probe prints each one's exit status
(negative: the signal that killed it), its last step, and the end of its error output.

    python scripts/probe_aoti_loader.py [cuda|cpu]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from torch import nn

# Every child: the package's path and the device in `path` and `device`, x and w made there
# unless the load says otherwise (`make_inputs()`), and `step(name)` printed as it begins.
PRELUDE = """
import ctypes, sys, torch
path, device, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
def step(name):
    print("step:", name, flush=True)
def make_inputs():
    step("inputs on " + device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g).to(device, dtype)
    w = torch.randn(64, 32, generator=g).to(device, dtype)
    return x, w
def check(out, x, w):
    ref = torch.nn.functional.silu(x @ w) * 2
    print("match:", torch.allclose(out.float(), ref.float(), atol=0.1, rtol=0.05), tuple(out.shape))
"""

PACKAGE_LOADER = """
index = 0 if device == "cuda" else -1
step("AOTIModelPackageLoader")
package = torch._C._aoti.AOTIModelPackageLoader(path, "model", True, 1, index)
x, w = make_inputs()
step("run")
check(package.run([x, w])[0], x, w)
"""

# The container's C interface (torch/csrc/inductor/aoti_runtime/interface.h); tensors cross it
# as at::Tensor handles, which torch._C._aoti makes and takes back as capsules.
CONTAINER = """
import zipfile, tempfile
api = ctypes.pythonapi
api.PyCapsule_GetPointer.restype = ctypes.c_void_p
api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
api.PyCapsule_New.restype = ctypes.py_object
api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
x, w = make_inputs()
model_dir = tempfile.mkdtemp()
step("extract")
with zipfile.ZipFile(path) as z:
    z.extractall(model_dir)
libraries = sorted(__import__("pathlib").Path(model_dir).rglob("*.so"))
(so,) = [p for p in libraries if p.name.endswith(".wrapper.so")] or libraries
step("dlopen " + so.name)
lib = ctypes.CDLL(str(so))
handle = ctypes.c_void_p()
step("create the container")
name = device + (":0" if device == "cuda" else "")
error = lib.AOTInductorModelContainerCreateWithDevice(
    ctypes.byref(handle), ctypes.c_size_t(1), name.encode(), str(so.parent).encode())
assert error == 0, f"create: error {error}"
inputs = [api.PyCapsule_GetPointer(c, None)
          for c in torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors([x, w])]
outputs = (ctypes.c_void_p * 1)()
stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream if device == "cuda" else None)
step("run")
error = lib.AOTInductorModelContainerRun(
    handle, (ctypes.c_void_p * 2)(*inputs), ctypes.c_size_t(2), outputs, ctypes.c_size_t(1),
    stream, None)
assert error == 0, f"run: error {error}"
(out,) = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(
    [api.PyCapsule_New(outputs[0], None, None)])
if device == "cuda":
    torch.cuda.synchronize()
check(out, x, w)
step("delete the container")
assert lib.AOTInductorModelContainerDelete(handle) == 0
"""

# name: (code after the prelude, extra environment)
LOADS: dict[str, tuple[str, dict[str, str]]] = {
    "load_package": (
        "x, w = make_inputs()\nstep('load_package')\n"
        "from torch._inductor.package import load_package\n"
        "model = load_package(path)\nstep('run')\ncheck(model(x, w)[0], x, w)\n",
        {},
    ),
    "AOTIModelPackageLoader": ("make_inputs()\n" + PACKAGE_LOADER, {}),
    "AOTIModelPackageLoader, no CUDA first": (PACKAGE_LOADER, {}),
    "AOTIModelPackageLoader, CUDA_MODULE_LOADING=EAGER": (
        "make_inputs()\n" + PACKAGE_LOADER,
        {"CUDA_MODULE_LOADING": "EAGER"},
    ),
    "container by ctypes": (CONTAINER, {}),
}


class TwoOps(nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        return (nn.functional.silu(x @ w) * 2,)


def _tail(text: str, lines: int) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    dtype = "bfloat16" if device == "cuda" else "float32"
    x, w = (
        torch.randn(5, 64, device=device, dtype=getattr(torch, dtype)),
        torch.randn(64, 32, device=device, dtype=getattr(torch, dtype)),
    )
    tokens = torch.export.Dim("tokens", min=1, max=8192)
    exported = torch.export.export(TwoOps(), (x, w), dynamic_shapes=({0: tokens}, None))
    if device == "cuda":
        print(f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}")
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "two_ops.pt2")
        torch._inductor.aoti_compile_and_package(exported, package_path=path)
        kinds = sorted({Path(n).suffix for n in zipfile.ZipFile(path).namelist()} - {""})
        print(f"torch {torch.__version__}, {device}: compiled {path} (files {', '.join(kinds)})")
        for name, (load, env) in LOADS.items():
            done = subprocess.run(
                [sys.executable, "-X", "faulthandler", "-c", PRELUDE + load, path, device, dtype],
                capture_output=True,
                text=True,
                env=os.environ | env,
            )
            steps = [line for line in done.stdout.splitlines() if line.startswith("step:")]
            result = [line for line in done.stdout.splitlines() if line.startswith("match:")]
            print(
                f"{name}: exit status {done.returncode}; last {steps[-1] if steps else 'none'}; "
                f"{result[-1] if result else 'no result'}"
            )
            if done.returncode != 0:
                print(f"  stderr: {_tail(done.stderr, 8)[:1200]}")


if __name__ == "__main__":
    main()
