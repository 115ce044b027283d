"""The device side: weights, KV cache, attention backend, one forward step per batch plan."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from srt.batch_layout import ForwardMode
from srt.compilation.cache import (
    CompileCache,
    default_cache_root,
    open_cache_root,
    point_tool_caches,
)
from srt.compilation.cache_key import collect_factors
from srt.compilation.compile_info import CompileInfo
from srt.compilation.op_registry import split_ops
from srt.distributed import (
    broadcast_object,
    destroy_tp,
    even_shard,
    gather_objects,
    init_tp,
    kv_head_shard,
    min_over_ranks,
)
from srt.forward_batch import ForwardBatch, forward_batch_from_host, to_device_packed
from srt.ipc.messages import BatchPlan, BatchResult
from srt.ipc.reports import jsonable
from srt.layers.attention.base import attention_backend_class
from srt.layers.custom_op import apply_custom_ops, custom_ops_info, describe_custom_ops
from srt.layers.sampler import SamplingArrays, SamplingBuffers, logprobs_of, sample
from srt.model_config import ModelConfig
from srt.model_executor.graphs.config import Backend, resolve_graph_config
from srt.model_executor.graphs.graph_runner import GraphRunner, init_attention_graph_state
from srt.model_executor.graphs.phase_forward import RunnerEnv
from srt.model_executor.graphs.pool import GraphPool
from srt.model_executor.jit_misses import JitMissLog
from srt.model_executor.kv_cache import KVCache, kv_bytes_per_token
from srt.model_executor.model_loader import load_model
from srt.model_executor.warmup import WARMUP_ROW, warmup_plans
from srt.op_selection import OpImpl, asks_for_kernels, kernels_missing, resolve_custom_ops
from srt.server_args import ServerArgs
from srt.tp_rank import TPRank

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_SLOTS = 65536


def init_cuda(device: torch.device, dtype: torch.dtype) -> None:
    """Make the CUDA context and cuBLAS's handles now, where the startup breakdown times them
    (else the weight load or the warm-up's first matmul pays for them, unseen)."""
    torch.cuda.set_device(device.index or 0)
    a = torch.ones(16, 16, dtype=dtype, device=device)
    (a @ a).sum().item()


class PendingResult:
    """A launched step's sampled ids (and logprobs) on their way to the host: copied behind
    the step, into pinned memory, with an event that says when they are there (on the CPU
    the copy is the tensor itself, done at once)."""

    def __init__(self, tensors: list[torch.Tensor], step: int) -> None:
        self.step = step
        self.event: torch.cuda.Event | None = None
        if tensors[0].is_cuda:
            # non_blocking into a new CPU tensor pins it, so the copy is asynchronous.
            self.host = [t.to("cpu", non_blocking=True) for t in tensors]
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensors

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> BatchResult:
        if self.event is not None:
            self.event.synchronize()
        arrays = [t.numpy() for t in self.host]
        result = BatchResult(next_token_ids=arrays[0], step=self.step)
        if len(arrays) > 1:
            result.logprobs = arrays[1]
        if len(arrays) > 2:
            result.top_logprob_vals, result.top_logprob_ids = arrays[2], arrays[3]
        return result


class ModelRunner:
    """One rank's device side. With tensor parallelism every rank builds one; rank 0's
    `launch` passes each plan on to the others (`follow`), so that all run every step."""

    def __init__(self, args: ServerArgs, config: ModelConfig, tp: TPRank | None = None) -> None:
        self.args = args
        self.config = config
        self.tp = tp or TPRank()
        self.device = torch.device(args.resolved_device())
        # Triton's and Inductor's caches under the compile cache root before any kernel
        # compiles, with graphs or without: a restart finds the kernels its warm-up JIT-ed.
        self.cache_root = open_cache_root(Path(args.compile_cache_dir or default_cache_root()))
        point_tool_caches(self.cache_root)
        start = time.perf_counter()
        if self.device.type == "cuda":
            if self.tp.size > 1:  # one GPU per rank (the flag check refuses cuda:N here)
                self.device = torch.device("cuda", self.tp.rank)
            init_cuda(self.device, config.dtype)
        self.device_init_s = time.perf_counter() - start
        init_tp(self.tp, self.device)  # before the model: its layers take their shards
        # The heads this rank holds: its attention backend and KV cache see only those.
        self.rank_config = dataclasses.replace(
            config,
            num_heads=even_shard(config.num_heads).size,
            num_kv_heads=kv_head_shard(config.num_kv_heads).size,
        )
        torch.manual_seed(args.seed)
        self.attention_backend_name = args.attention_backend or (
            "triton" if self.device.type == "cuda" else "torch_native"
        )
        attn_cls = attention_backend_class(self.attention_backend_name)
        self.graph_configs = resolve_graph_config(  # fail before loading
            args, self.device.type, ForwardMode.DECODE in attn_cls.graph_modes
        )

        start = time.perf_counter()
        self.model = load_model(config, self.device, args.load_format, args.seed)
        self.load_s = time.perf_counter() - start
        logger.info("loaded %s (%s) in %.2f s", config.architecture, config.dtype, self.load_s)
        start = time.perf_counter()
        self.custom_ops = self._select_custom_ops()  # before any trace: it shapes the graph
        self.custom_ops_s = time.perf_counter() - start  # with the kernels' import of triton

        start = time.perf_counter()
        self.num_slots = self._kv_slots()
        self.kv_cache = KVCache(self.rank_config, self.num_slots, self.device)
        self.kv_alloc_s = time.perf_counter() - start
        for layer, k, v in zip(
            self.model.attention_layers(), self.kv_cache.k, self.kv_cache.v, strict=True
        ):
            layer.bind_kv_cache(k, v)
        self.context_length = min(config.context_length, self.num_slots - 1)
        self.req_to_token = torch.zeros(
            (args.max_running_requests, self.context_length),
            dtype=torch.int32,
            device=self.device,
        )
        self.attn_backend = attn_cls(
            self.rank_config.num_heads, self.rank_config.num_kv_heads, config.head_dim
        )
        logger.info(
            "KV cache: %d slots, %.1f MiB; attention backend %s",
            self.num_slots,
            self.kv_cache.nbytes / 2**20,
            self.attention_backend_name,
        )
        self.graph_pool = GraphPool(self.device, args.cuda_graph_mem_fraction)
        self.compile_cache = self._open_compile_cache()
        env = RunnerEnv(
            self.model,
            self.attn_backend,
            self.req_to_token,
            args.max_running_requests,
            self.graph_pool,
            self.compile_cache,
            args,
            self.graph_configs,
        )
        self.phase_runners = {
            phase.mode: GraphRunner(phase, c, env) for phase, c in self.graph_configs.items()
        }
        init_attention_graph_state(self.phase_runners.values(), env)
        self.piecewise = env.piecewise  # the compiled phases' traced model, if any
        logger.info("split ops: %s", ", ".join(split_ops()))
        # The last launched step's sampled ids, which the next decode plan may take its
        # inputs from (overlap scheduling), and that step's number.
        self.last_sampled: torch.Tensor | None = None
        self.last_step = -1
        self.warmup_s = 0.0 if args.skip_warmup else self._warm_up()
        self.capture_s = self._prewarm()
        # Ready from here on: a JIT compile now is one the first requests wait for.
        self.jit_misses = JitMissLog()
        self.jit_misses.arm()
        self.ranks = gather_objects(
            {"rank": self.tp.rank, "pid": os.getpid(), "device": str(self.device)}
        )

    def _select_custom_ops(self) -> dict[str, OpImpl]:
        missing = kernels_missing(self.device.type)
        impls = resolve_custom_ops(self.args.custom_ops, missing)
        if missing is not None and asks_for_kernels(self.args.custom_ops):
            logger.warning("--custom-ops asks for kernels, but %s: the reference runs", missing)
        apply_custom_ops(self.model, impls)
        logger.info("custom ops: %s", "; ".join(describe_custom_ops(impls)))
        return impls

    def _kv_slots(self) -> int:
        if self.args.max_total_tokens:
            return self.args.max_total_tokens + 1
        if self.device.type != "cuda":
            return CPU_DEFAULT_KV_SLOTS + 1
        free, total = torch.cuda.mem_get_info(self.device)
        graphs = any(c.backend is not Backend.DISABLED for c in self.graph_configs.values())
        graph_fraction = self.args.cuda_graph_mem_fraction if graphs else 0.0
        budget = total * (self.args.mem_fraction_static - graph_fraction)
        budget -= total - free
        # Every rank sizes its own cache; all must agree on the slots the scheduler plans with.
        slots = min_over_ranks(int(budget // kv_bytes_per_token(self.rank_config)))
        if slots < 2:
            raise RuntimeError(
                "no GPU memory left for the KV cache: raise --mem-fraction-static "
                "or set --max-total-tokens"
            )
        return slots

    def make_forward_batch(self, plan: BatchPlan) -> ForwardBatch:
        """Copy a plan to the device and apply its request-to-token table writes; decode
        inputs that are the previous step's samples are taken from the device."""
        if plan.input_from_prev is not None:
            assert plan.step == self.last_step + 1, "ids come only from the step just before"
        if len(plan.table_rows):
            rows, cols, slots = to_device_packed(
                [plan.table_rows, plan.table_cols, plan.table_slots], self.device
            )
            self.req_to_token[rows, cols] = slots.to(torch.int32)
        return forward_batch_from_host(
            ForwardMode(plan.forward_mode),
            plan.input_ids,
            plan.positions,
            plan.out_cache_loc,
            plan.req_pool_indices,
            plan.prefix_lens,
            plan.extend_lens,
            self.req_to_token,
            plan.input_from_prev,
            self.last_sampled,
        )

    def _warm_up(self) -> float:
        """Run the `warmup` plans through each phase's general path, so that what compiles on
        first use compiles now; serving sees no state of it (the table row is restored, KV
        went to the dummy slot, random state is forked). Returns the seconds it took."""
        start = time.perf_counter()
        plans = warmup_plans(self.context_length)
        row = self.req_to_token[WARMUP_ROW].clone()
        with (
            torch.inference_mode(),
            torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []),
        ):
            for plan in plans:
                batch = self.make_forward_batch(plan)
                self.sample(plan, batch, self.phase_runners[batch.mode].run_general(batch)).wait()
            self.req_to_token[WARMUP_ROW].copy_(row)
        self.last_sampled, self.last_step = None, -1  # no serving step follows a dummy one
        seconds = time.perf_counter() - start  # each step's result was waited for
        logger.info(
            "warm-up: %d dummy steps (prefill over a prefix, decode, sampling, logprobs) in "
            "%.2f s (--skip-warmup skips it)",
            len(plans),
            seconds,
        )
        return seconds

    def _prewarm(self) -> float:
        """Capture before serving: every bucket (`upfront`) or those the manifest recorded
        (`manifest`); `lazy` captures nothing now. Returns the seconds it took."""
        mode = self.args.cuda_graph_capture
        if mode == "lazy" or self.compile_cache is None:
            return 0.0
        recorded = self.compile_cache.manifest.buckets
        start = time.perf_counter()
        with torch.inference_mode():
            for phase, config in self.graph_configs.items():
                buckets = config.bs if mode == "upfront" else recorded.get(phase.value, [])
                self.phase_runners[phase.mode].prewarm(buckets)
        seconds = time.perf_counter() - start
        logger.info("%s capture: %d graphs in %.2f s", mode, self.graph_pool.captures, seconds)
        return seconds

    def _open_compile_cache(self) -> CompileCache | None:
        """The compile cache entry of this setup (pieces, capture manifest), when any phase
        compiles or captures."""
        if all(
            c.backend is Backend.DISABLED and c.tc_compiler is None
            for c in self.graph_configs.values()
        ):
            return None
        args = self.args
        factors = collect_factors(
            {
                "model": self.config.hf_config,
                "dtype": str(self.config.dtype),
                "attention_backend": self.attention_backend_name,
                # Not the bucket ladders: artifacts are general over the token range (which
                # their names carry), so a new ladder reuses them.
                "graphs": {
                    p.value: [c.backend.value, c.tc_compiler] for p, c in self.graph_configs.items()
                },
                "max_running_requests": args.max_running_requests,
                "enable_torch_compile": args.enable_torch_compile,
                "torch_compile_max_bs": args.torch_compile_max_bs,
                "keep_shape_guards": args.keep_shape_guards,
                "custom_ops": custom_ops_info(self.custom_ops),
                # Each rank traces and compiles its own shard's graph.
                "tp": [self.tp.size, self.tp.rank],
            },
            self.device,
            Path(inspect.getfile(type(self.model))),
            inductor=args.enable_torch_compile
            or any(c.tc_compiler == "inductor" for c in self.graph_configs.values()),
        )
        return CompileCache(self.cache_root, factors)

    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, V] of each request's last token, through the phase's runner (valid
        until the next call: a captured phase returns a view of its static output)."""
        return self.phase_runners[batch.mode].run(batch)

    @torch.inference_mode()
    def launch(self, plan: BatchPlan) -> PendingResult:
        """Start a step; its result is copied to the host behind the step (on CUDA the call
        returns before the step has run, so the next plan can be launched meanwhile). On rank
        0 of several, the other ranks get the plan first and run it too: their collectives
        meet rank 0's, their results are dropped (they sample the same ids from the same
        gathered logits)."""
        if self.tp.size > 1:
            assert self.tp.is_leader, "only rank 0 is given plans; the others follow it"
            broadcast_object(plan)
        return self._launch(plan)

    def _launch(self, plan: BatchPlan) -> PendingResult:
        batch = self.make_forward_batch(plan)
        self.jit_misses.step = batch.mode, batch.batch_size, batch.num_tokens
        logits = self.forward_logits(batch)
        return self.sample(plan, batch, logits, self.phase_runners[batch.mode])

    def sample(
        self,
        plan: BatchPlan,
        batch: ForwardBatch,
        logits: torch.Tensor,
        runner: GraphRunner | None = None,
    ) -> PendingResult:
        """Each request's next token from `logits` [B, V], with the logprobs the plan asks for,
        on its way to the host; the ids stay on the device for the next plan too. `runner`:
        the phase runner whose `run` returned the logits, where its graph may have taken their
        argmax already, or may sample them in a graph of its own."""
        greedy = runner.take_greedy() if runner is not None else None
        if not plan.temperatures.any():  # all greedy: no parameters to upload
            next_ids = greedy if greedy is not None else sample(logits, None)
        else:
            arrays = SamplingArrays(
                plan.temperatures, plan.top_ps, plan.top_ks, plan.min_ps, plan.seeds
            )
            in_graph = runner.take_sampled(arrays) if runner is not None else None
            if in_graph is not None:
                next_ids = in_graph
            else:
                params = SamplingBuffers(len(arrays.seeds), self.device)
                next_ids = sample(logits, params.load(arrays, batch.seq_lens), greedy)
        self.last_sampled, self.last_step = next_ids, plan.step
        outputs = [next_ids]
        if plan.return_logprob:
            chosen, top = logprobs_of(logits, next_ids, plan.top_logprobs_num)
            outputs.append(chosen)
            if top is not None:
                outputs += top
        return PendingResult(outputs, plan.step)

    def forward(self, plan: BatchPlan) -> BatchResult:
        """Run a step and wait for its result."""
        return self.launch(plan).wait()

    @torch.inference_mode()
    def follow(self) -> None:
        """A rank other than 0: run every plan rank 0 passes on, until it says stop."""
        assert not self.tp.is_leader
        while (plan := broadcast_object()) is not None:
            self._launch(plan)
        destroy_tp()

    def close(self) -> None:
        """Rank 0: tell the other ranks to stop, and leave the group."""
        if self.tp.size > 1 and self.tp.is_leader:
            broadcast_object(None)
        destroy_tp()

    def info(self) -> dict[str, Any]:
        return {
            "device": str(self.device),
            "dtype": str(self.config.dtype).removeprefix("torch."),
            "attention_backend": self.attention_backend_name,
            "kv_slots": self.num_slots - 1,
            "kv_cache_bytes": self.kv_cache.nbytes,
            "context_length": self.context_length,
            "tp_size": self.tp.size,
            "tp_ranks": self.ranks,
            "device_init_s": round(self.device_init_s, 3),
            "load_s": round(self.load_s, 3),
            "custom_ops_s": round(self.custom_ops_s, 3),
            "kv_alloc_s": round(self.kv_alloc_s, 3),
            "warmup_s": round(self.warmup_s, 3),
            "capture_s": round(self.capture_s, 3),
            "jit_misses": self.jit_misses.info(),
            "graph_pool": self.graph_pool.info(),
            "compile": jsonable(
                self.piecewise.info()
                if self.piecewise is not None
                else CompileInfo.none(split_ops())
            ),
            "custom_ops": custom_ops_info(self.custom_ops),
            "graphs": {
                phase.value: jsonable(self.phase_runners[phase.mode].info())
                for phase in self.graph_configs
            },
        }
