"""What each process imports: `import srt` and the scheduler process stay torch-free.

Each check runs in a fresh interpreter, since this one has long imported torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "srt.models", "srt.model_executor", "srt.layers")


def imported_after(module: str, then: str = "") -> list[str]:
    """Every module loaded by importing `module` (and running `then`) in a fresh interpreter."""
    code = f"import json, sys\nimport {module}\n{then}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def heavy(modules: list[str], banned: tuple[str, ...]) -> list[str]:
    return [m for m in modules if any(m == b or m.startswith(b + ".") for b in banned)]


def test_import_srt_is_light() -> None:
    modules = imported_after("srt")
    assert "srt" in modules
    assert heavy(modules, HEAVY) == []


@pytest.mark.parametrize(
    "module",
    [
        "srt.scheduler.scheduler_process",
        "srt.server.request_frontend",
        "srt.sampling_params",
        "srt.batch_layout",
        "srt.model_config",
        "srt.launch_server",
        "srt.compilation",
        "srt.compilation.compile_info",
        "srt.compilation.bucket_manifest",
    ],
)
def test_torch_free_module(module: str) -> None:
    modules = imported_after(module)
    assert module in modules
    assert heavy(modules, HEAVY) == []


def test_checking_the_flags_imports_no_torch() -> None:
    # The launcher checks them before it spawns anything: a second of torch here would be a
    # second on every start.
    modules = imported_after("srt.server_args", "srt.server_args.ServerArgs().check()")
    assert "srt.op_selection" in modules
    assert heavy(modules, HEAVY) == []


def test_launcher_entry_skips_the_web_stack() -> None:
    # The launcher binds its port and spawns the children before paying for these.
    modules = imported_after("srt.launch_server")
    assert heavy(modules, ("fastapi", "uvicorn", "starlette", "pydantic")) == []


def test_a_plain_fast_tokenizer_loads_without_torch(tiny_llama: Path) -> None:
    # The tiny llama's tokenizer_config names PreTrainedTokenizerFast, as Llama 3's do.
    then = f"srt.server.hf_tokenizer.load_tokenizer({str(tiny_llama)!r})"
    modules = imported_after("srt.server.hf_tokenizer", then)
    assert "transformers" in modules and heavy(modules, ("torch",)) == []


def test_the_shortcut_loads_what_auto_tokenizer_does(tiny_llama: Path) -> None:
    from transformers import AutoTokenizer

    from srt.server.hf_tokenizer import load_tokenizer

    ours, auto = load_tokenizer(tiny_llama), AutoTokenizer.from_pretrained(str(tiny_llama))
    assert type(ours) is type(auto)
    chat = [{"role": "user", "content": "hello"}]
    for tok in (ours, auto):
        assert tok.encode("the lighthouse") == auto.encode("the lighthouse")
        assert tok.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(
            chat, tokenize=False
        )
        assert tok.eos_token_id == auto.eos_token_id and tok.get_vocab() == auto.get_vocab()


def test_the_runner_skips_the_compiler_until_a_phase_compiles() -> None:
    # sympy comes with Dynamo's shape machinery: a quarter of a second of the runner's start.
    modules = imported_after("srt.model_executor.runner_process")
    assert heavy(modules, ("sympy", "torch._dynamo", "srt.compilation.piecewise_model")) == []


def test_check_sees_torch() -> None:
    # The check itself can fail: the runner's modules do import torch.
    assert "torch" in imported_after("srt.model_executor.runner_process")


def test_serving_without_compiling_imports_no_dynamo(tiny_llama: Path) -> None:
    # Importing Dynamo costs seconds (about as much as torch itself on some hosts); a runner
    # that compiles nothing must not pay it, neither at start nor on its first requests (a
    # torch.library op's own dispatch would import it on first call).
    then = (
        f"eng = srt.Engine(model_path={str(tiny_llama)!r}, device='cpu', dtype='float32')\n"
        "eng.generate(input_ids=[[5, 6, 7]], sampling_params={'max_new_tokens': 3})\n"
        "eng.shutdown()"
    )
    modules = imported_after("srt", then)
    assert "srt.model_executor.model_runner" in modules
    assert heavy(modules, ("torch._dynamo", "torch._inductor")) == []


def test_loading_the_tokenizer_imports_no_torch(tiny_llama: Path) -> None:
    # The launcher loads it; some transformers releases import torch from their tokenizer
    # module whenever it is installed (seconds). Hidden from them, torch stays importable,
    # and their "PyTorch was not found" warning is not in the log.
    code = (
        "import sys\n"
        "from srt.server.hf_tokenizer import load_tokenizer\n"
        f"tok = load_tokenizer({str(tiny_llama)!r})\n"
        "print('torch' in sys.modules, tok.decode(tok.encode('hello')))\n"
        "import torch\n"
        "print(torch.ones(1).item())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    imported_torch, text = out.stdout.splitlines()[0].split(" ", 1)
    assert imported_torch == "False" and "hello" in text
    assert out.stdout.splitlines()[1] == "1.0"  # torch itself still imports afterwards
    assert "PyTorch was not found" not in out.stderr
