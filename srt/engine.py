"""The in-process engine: scheduler and model runner in the calling process.

from srt import Engine
engine = Engine(model_path="...", device="cpu", dtype="float32")
engine.generate(prompt=["Hello"], sampling_params={"max_new_tokens": 16, "temperature": 0})

With `tp_size=N` the calling process is rank 0 and ranks 1..N-1 are spawned child processes
(tied to it: they die with it), stopped by `shutdown()`.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
import uuid
from typing import Any

import torch

from srt.ipc.messages import GenerateReq
from srt.ipc.reports import jsonable
from srt.model_config import ModelConfig, warn_past_positions
from srt.model_executor.rank_processes import start_ranks, stop_ranks
from srt.scheduler.scheduler import Scheduler
from srt.server.hf_tokenizer import load_tokenizer
from srt.server.request_frontend import RequestFrontend
from srt.server.seq_outputs import SeqDecoder, SeqResult
from srt.server_args import ServerArgs
from srt.tools.make_tiny_model import resolve_model_path

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, **kwargs: Any) -> None:
        start = time.perf_counter()
        self.server_args = ServerArgs.from_kwargs(**kwargs)
        args = self.server_args
        args.check()
        args.model_path = resolve_model_path(args.model_path)
        self.model_config = ModelConfig.from_path(args.model_path, args.dtype, args.context_length)
        warn_past_positions(self.model_config, args.context_length)
        args.check_model(self.model_config)
        self.tokenizer = load_tokenizer(args.tokenizer_path or args.model_path)
        self.runner, self.followers = start_ranks(args, self.model_config)
        self.scheduler = Scheduler(
            args,
            num_slots=self.runner.num_slots,
            context_length=self.runner.context_length,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=self.model_config.eos_token_ids,
        )
        self.frontend = RequestFrontend(self.tokenizer, self.scheduler.limits)
        self.startup_s = time.perf_counter() - start

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or a list of prompts (a list of dicts).

        Requests are checked by the same front end as the server's (InvalidRequest, a
        ValueError, for one that cannot be served). Each result has `text`, `output_ids` and
        `meta_info` (finish_reason, matched_stop, prompt_tokens, completion_tokens,
        cached_tokens; with `logprobs: True` also `output_token_logprobs`, a (logprob,
        token_id) pair per output token, and with `top_logprobs_num: N`
        `output_top_logprobs`, N such pairs per output token).
        """
        single, seqs = self.frontend.native(prompt, input_ids, sampling_params, text_name="prompt")
        rids = [uuid.uuid4().hex for _ in seqs]
        decoders = {
            rid: SeqDecoder(i, self.tokenizer, seq.params)
            for i, (rid, seq) in enumerate(zip(rids, seqs, strict=True))
        }
        results = [SeqResult(i) for i in range(len(seqs))]
        running = set(rids)
        try:
            for rid, seq in zip(rids, seqs, strict=True):
                self.scheduler.add_request(GenerateReq(rid, seq.input_ids, seq.params))
            while running:
                for out in self.scheduler.step(self.runner.forward).unpack():
                    if out.rid not in running:
                        continue
                    update, abort = decoders[out.rid].update(out)
                    results[update.index].add(update)
                    if update.finish_reason is not None:
                        running.discard(out.rid)
                        if abort:  # a stop string: the scheduler, seeing only ids, runs it
                            self.scheduler.abort(out.rid)
        finally:
            for rid in running:
                self.scheduler.abort(rid)
        outputs = [r.native() for r in results]
        return outputs[0] if single else outputs

    def get_server_info(self) -> dict[str, Any]:
        runner = jsonable(self.runner.info())
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
            "scheduler": jsonable(self.scheduler.info()),
        }

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def shutdown(self) -> None:
        """Abort what is in flight and drop the model (frees device memory)."""
        for rid in list(self.scheduler.reqs):
            self.scheduler.abort(rid)
        device = self.runner.device if self.runner is not None else None
        if self.runner is not None:
            stop_ranks(self.runner, self.followers)
        self.runner = None  # type: ignore[assignment]
        gc.collect()
        if device is not None and device.type == "cuda":
            torch.cuda.empty_cache()  # so the next engine's KV sizing sees the memory free

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
