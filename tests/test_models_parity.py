"""Our models against transformers on the same tiny random checkpoints.

Prefill logits at every prompt position (all prompts in one batch, through the scheduler's plan
and the runner's forward batch), greedy decoding of 32 tokens against `generate`, and the
logprobs of the chosen tokens against transformers' logits at every decode step.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from srt import Engine
from srt.ipc.messages import GenerateReq
from srt.layers.attention.layer import eager_forward_context
from srt.sampling_params import SamplingParams
from srt.tools.make_tiny_model import CORPUS

CASES = {
    "llama": {"arch": "llama"},
    "qwen2": {"arch": "qwen2"},
    "qwen3": {"arch": "qwen3"},
    "llama-rope-llama3": {"arch": "llama", "rope_scaling": "llama3"},
    "llama-tied": {"arch": "llama", "tie_word_embeddings": True},
    "llama-sharded": {"arch": "llama", "num_shards": 3},
}
PROMPTS = ["The lighthouse keeper", "héllo ✓ 12345", "a"]
LONG_PROMPT_TOKENS = 300  # past llama3 scaling's original_max_position_embeddings (256)
NEW_TOKENS = 32


@dataclass
class Case:
    path: Path
    tokenizer: Any
    hf: torch.nn.Module  # float32
    engine: Engine  # float32, no prefix caching (each prompt is computed in full)
    prompts: list[list[int]]


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tiny_model_factory) -> Iterator[Case]:
    path = tiny_model_factory(**CASES[request.param])
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    prompts.append(tokenizer.encode(CORPUS)[:LONG_PROMPT_TOKENS])
    with Engine(
        model_path=str(path), device="cpu", dtype="float32", enable_prefix_caching=False
    ) as engine:
        yield Case(path, tokenizer, hf, engine, prompts)


def prefill_logits(engine: Engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Our logits [len(prompt), V] at every position, all prompts prefilled in one batch."""
    sched, runner = engine.scheduler, engine.runner
    rids = [f"parity-{i}" for i in range(len(prompts))]
    for rid, ids in zip(rids, prompts, strict=True):
        sched.add_request(GenerateReq(rid, ids, SamplingParams(max_new_tokens=1)))
    scheduled = sched.schedule()
    assert scheduled is not None
    plan = scheduled.plan
    assert plan.batch_size == len(prompts) and plan.num_tokens == sum(map(len, prompts))
    try:
        batch = runner.make_forward_batch(plan)
        with torch.inference_mode(), eager_forward_context(batch, runner.attn_backend):
            logits = runner.model.compute_logits(runner.model(batch.input_ids, batch.positions))
    finally:
        # The planned step must come back before its requests' slots are freed.
        sched.process_result(scheduled, runner.forward(plan))
    return list(logits.split(plan.extend_lens.tolist()))


@torch.no_grad()
def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error over the logit scale (the largest |logit|)."""
    return float((ours - ref).abs().max() / ref.abs().max())


def test_prefill_logits_match(case: Case) -> None:
    for ids, ours in zip(case.prompts, prefill_logits(case.engine, case.prompts), strict=True):
        ref = hf_logits(case.hf, ids)
        assert ours.shape == ref.shape
        assert relative_error(ours, ref) < 1e-4, len(ids)


def test_greedy_decoding_and_logprobs_match_generate(case: Case) -> None:
    results = case.engine.generate(
        input_ids=case.prompts,
        sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "logprobs": True},
    )
    for ids, result in zip(case.prompts, results, strict=True):
        with torch.no_grad():
            out = case.hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=case.tokenizer.pad_token_id,
            )
        expected = out.sequences[0, len(ids) :].tolist()  # stops after eos, as we do
        assert result["output_ids"] == expected
        finished_on_eos = len(expected) < NEW_TOKENS
        assert result["meta_info"]["finish_reason"] == ("stop" if finished_on_eos else "length")
        logprobs = result["meta_info"]["output_token_logprobs"]
        assert [t for _, t in logprobs] == expected
        ref = torch.stack(
            [
                torch.log_softmax(step[0].float(), -1)[t]
                for step, t in zip(out.logits, expected, strict=True)
            ]
        )
        ours = torch.tensor([lp for lp, _ in logprobs])
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


# bf16 rounds every activation to 8 bits of mantissa; over two layers of a random model whose
# logits reach ~7 (bf16 step 1/32 there), ours and transformers' bf16 differ by up to ~2% of
# the logit scale although both are correct. So: within 4% of the scale of transformers' bf16,
# and no further from the float32 logits than transformers' own bf16 is (within 1.5x).
BF16_TOLERANCE = 0.04
BF16_ERROR_RATIO = 1.5


def test_bfloat16_close_to_transformers_bfloat16(case: Case) -> None:
    hf_bf16 = AutoModelForCausalLM.from_pretrained(case.path, dtype=torch.bfloat16).eval()
    with Engine(
        model_path=str(case.path), device="cpu", dtype="bfloat16", enable_prefix_caching=False
    ) as engine:
        ours = prefill_logits(engine, case.prompts)
    for ids, logits in zip(case.prompts, ours, strict=True):
        ref32 = hf_logits(case.hf, ids)
        ref16 = hf_logits(hf_bf16, ids)
        assert relative_error(logits, ref16) < BF16_TOLERANCE
        assert relative_error(logits, ref32) < BF16_ERROR_RATIO * relative_error(ref16, ref32)


def test_llama_attention_bias(tiny_llama: Path, tmp_path: Path) -> None:
    """`attention_bias: true` puts a bias on q, k, v and o in Llama (make_tiny_model has none)."""
    config = AutoConfig.from_pretrained(tiny_llama)
    config.attention_bias = True
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.2)
    hf.save_pretrained(tmp_path)
    for file in tiny_llama.glob("tokenizer*"):
        shutil.copy(file, tmp_path)
    prompts = [[1, 2, 3, 4, 5], [7] * 9]
    with Engine(model_path=str(tmp_path), device="cpu", dtype="float32") as engine:
        ours = prefill_logits(engine, prompts)
    for ids, logits in zip(prompts, ours, strict=True):
        assert relative_error(logits, hf_logits(hf, ids)) < 1e-4


@pytest.mark.gpu
def test_cuda_torch_native_matches_transformers(case: Case) -> None:
    greedy = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}
    with Engine(
        model_path=str(case.path),
        device="cuda",
        dtype="float32",
        attention_backend="torch_native",
        enable_prefix_caching=False,
        max_total_tokens=4096,
    ) as engine:
        for ids, ours in zip(case.prompts, prefill_logits(engine, case.prompts), strict=True):
            assert relative_error(ours.cpu(), hf_logits(case.hf, ids)) < 1e-4
        on_cuda = engine.generate(input_ids=case.prompts, sampling_params=greedy)
    on_cpu = case.engine.generate(input_ids=case.prompts, sampling_params=greedy)
    assert [r["output_ids"] for r in on_cuda] == [r["output_ids"] for r in on_cpu]
