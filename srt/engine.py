"""The in-process engine: scheduler and model runner in the calling process.

    from srt import Engine
    engine = Engine(model_path="...", device="cpu", dtype="float32")
    engine.generate(prompt=["Hello"], sampling_params={"max_new_tokens": 16, "temperature": 0})
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
import uuid
from typing import Any

import torch

from srt.managers.io_struct import GenerateReq, TokenOutput
from srt.managers.scheduler import Scheduler
from srt.managers.tokenizer import IncrementalDetokenizer, load_tokenizer
from srt.model_config import ModelConfig
from srt.model_executor.model_runner import ModelRunner
from srt.sampling_params import SamplingParams
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def resolve_model_path(args: ServerArgs) -> str:
    """The model to serve: the given path, else the built-in tiny model (made on first use)."""
    if args.model_path:
        return args.model_path
    from srt.tools.make_tiny_model import default_model_dir

    return str(default_model_dir())


class Engine:
    def __init__(self, **kwargs: Any) -> None:
        start = time.perf_counter()
        self.server_args = ServerArgs.from_kwargs(**kwargs)
        args = self.server_args
        args.model_path = resolve_model_path(args)
        self.model_config = ModelConfig.from_path(args.model_path, args.dtype, args.context_length)
        self.tokenizer = load_tokenizer(args.tokenizer_path or args.model_path)
        self.runner = ModelRunner(args, self.model_config)
        self.scheduler = Scheduler(
            args,
            num_slots=self.runner.num_slots,
            context_length=self.runner.context_length,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=self.model_config.eos_token_ids,
            decode_tail=self.tokenizer.decode,
        )
        self.startup_s = time.perf_counter() - start

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or a list of prompts (a list of dicts).

        Each result has `text`, `output_ids` and `meta_info` (finish_reason, matched_stop,
        prompt_tokens, completion_tokens, cached_tokens; with `logprobs: True` also
        `output_token_logprobs`, a (logprob, token_id) pair per output token, and with
        `top_logprobs_num: N` `output_top_logprobs`, N such pairs per output token).
        """
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else list(prompt)
            if not all(isinstance(p, str) for p in prompts):
                raise ValueError("prompt must be a string or a list of strings")
            ids_list = [self.tokenizer.encode(p) for p in prompts]
        else:
            ids_list, single = _id_lists(input_ids)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids_list):
                raise ValueError("sampling_params list must match the number of prompts")
            params_list = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params_list = [SamplingParams.from_dict(sampling_params) for _ in ids_list]

        rids = [uuid.uuid4().hex for _ in ids_list]
        pending = {
            rid: _Pending(IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens, p.stop), p)
            for rid, p in zip(rids, params_list, strict=True)
        }
        results: dict[str, dict[str, Any]] = {}
        try:
            for rid, ids, params in zip(rids, ids_list, params_list, strict=True):
                self.scheduler.add_request(GenerateReq(rid, ids, dataclasses.replace(params)))
            while len(results) < len(rids):
                for out in self.scheduler.step(self.runner.forward):
                    result = pending[out.rid].collect(out)
                    if result is not None:
                        results[out.rid] = result
        finally:
            for rid in rids:
                if rid not in results:
                    self.scheduler.abort(rid)
        outputs = [results[rid] for rid in rids]
        return outputs[0] if single else outputs

    def get_server_info(self) -> dict[str, Any]:
        runner = self.runner.info()
        return {
            "server_args": dataclasses.asdict(self.server_args),
            "model": {
                "path": str(self.model_config.path),
                "architecture": self.model_config.architecture,
                "num_layers": self.model_config.num_layers,
                "vocab_size": self.model_config.vocab_size,
            },
            "startup_s": round(self.startup_s, 3),
            "runner": runner,
            "graphs": runner["graphs"],
            "compile": runner["compile"],
            "scheduler": self.scheduler.info(),
        }

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def shutdown(self) -> None:
        """Abort what is in flight and drop the model (frees device memory)."""
        for rid in list(self.scheduler.reqs):
            self.scheduler.abort(rid)
        device = self.runner.device if self.runner is not None else None
        self.runner = None  # type: ignore[assignment]
        gc.collect()
        if device is not None and device.type == "cuda":
            torch.cuda.empty_cache()  # so the next engine's KV sizing sees the memory free

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _id_lists(input_ids: Any) -> tuple[list[list[int]], bool]:
    """(one id list per prompt, whether a single prompt was given) for `input_ids`."""
    if not isinstance(input_ids, list | tuple):
        raise ValueError("input_ids must be a list of token ids or a list of such lists")
    nested = [isinstance(i, list | tuple) for i in input_ids]
    if input_ids and all(nested):
        return [list(i) for i in input_ids], False
    if any(nested):
        raise ValueError("input_ids mixes token ids and lists of token ids")
    return [list(input_ids)], True


class _Pending:
    """One request of a `generate` call: its text so far and the logprobs it asked for."""

    def __init__(self, detok: IncrementalDetokenizer, params: SamplingParams) -> None:
        self.detok = detok
        self.params = params
        self.token_logprobs: list[tuple[float, int]] = []
        self.top_logprobs: list[list[tuple[float, int]]] = []

    def collect(self, out: TokenOutput) -> dict[str, Any] | None:
        """Take one step's output; the finished result once the request is done."""
        self.detok.push(out.new_token_ids)
        if self.params.logprobs:
            self.token_logprobs += zip(out.logprobs, out.new_token_ids, strict=True)
            self.top_logprobs += [[(v, t) for t, v in top] for top in out.top_logprobs]
        if out.finished_reason is None:
            return None
        self.detok.finish()
        meta = {
            "finish_reason": out.finished_reason,
            "matched_stop": out.matched_stop,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens,
        }
        if self.params.logprobs:
            meta["output_token_logprobs"] = self.token_logprobs
        if self.params.top_logprobs_num:
            meta["output_top_logprobs"] = self.top_logprobs
        return {"text": self.detok.text, "output_ids": list(self.detok.ids), "meta_info": meta}
