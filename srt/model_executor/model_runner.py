"""The device side: weights, KV cache, attention backend, one forward step per batch plan.

A step, start to end (`launch`): the plan goes to its phase's `GraphRunner` (graphs/), which
uploads it once, fresh or padded into a captured bucket's static buffer, and runs or replays
the forward; `sampling.next_token_ids` takes the graph's argmax, replays its sampler or
samples here; each request's id stays on the device, as its table row's latest id, for the
plans launched before it is back on the host (overlap), and goes to the host behind the step
(`PendingResult`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import torch

from srt import flashinfer_support
from srt.batch_layout import ForwardMode
from srt.compilation.cache_root import default_cache_root, open_cache_root, point_tool_caches
from srt.compilation.compile_info import CompileInfo
from srt.compilation.op_registry import split_ops
from srt.compilation.triton_ahead import AheadBlock, start_triton_setup
from srt.compilation.triton_workers import CompileWorkers, disk_cache_entries
from srt.distributed import (
    broadcast_object,
    destroy_tp,
    even_shard,
    gather_objects,
    init_tp,
    kv_head_shard,
)
from srt.forward_batch import ForwardBatch
from srt.ipc.messages import BatchPlan, BatchResult
from srt.ipc.reports import CompileAheadInfo, RankInfo, RunnerInfo
from srt.layers.attention.base import AttentionBackend
from srt.layers.attention.registry import attention_backend_class
from srt.layers.custom_op import custom_ops_info
from srt.layers.linear import warm_skinny_matmuls
from srt.model_config import ModelConfig
from srt.model_executor.graphs.config import resolve_compile_passes, resolve_graph_config
from srt.model_executor.graphs.graph_runner import GraphRunner, init_attention_graph_state
from srt.model_executor.graphs.phase_forward import RunnerEnv
from srt.model_executor.graphs.pool import GraphPool
from srt.model_executor.jit_misses import JitMissLog, flashinfer_builds, install_hooks
from srt.model_executor.kv_cache import KVCache
from srt.model_executor.model_loader import construct_model, fill_weights
from srt.model_executor.runner_setup import (
    attention_backend_name,
    init_cuda,
    kv_slots,
    open_compile_cache,
    puts_norms_in_products,
    select_custom_ops,
    skinny_launch,
)
from srt.model_executor.sampling import PendingResult, next_token_ids, step_result
from srt.model_executor.step_inputs import upload_step
from srt.model_executor.warmup import WARMUP_ROW, warmup_plans
from srt.server_args import ServerArgs, usable_cpus
from srt.tp_rank import TPRank

logger = logging.getLogger(__name__)


def _wait_for(setup: Future[None], what: str) -> None:
    """A step of `start_triton_setup` done; if it failed, the first launch does it again (and
    raises there, where the cause belongs)."""
    try:
        setup.result()
    except Exception as e:
        logger.warning("%s ahead failed: %s: %s", what, type(e).__name__, e)


def timed(step: Callable[[], object]) -> float:
    """Run `step`; the seconds it took (the startup breakdown's parts)."""
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


class ModelRunner:
    """One rank's device side. With tensor parallelism every rank builds one; rank 0's
    `launch` passes each plan on to the others (`follow`), so that all run every step."""

    def __init__(
        self,
        args: ServerArgs,
        config: ModelConfig,
        tp: TPRank | None = None,
        compile_workers: CompileWorkers | None = None,
    ) -> None:
        """`compile_workers`: processes the runner's entry started for the warm-up's compile
        ahead (`runner_entry`); stopped once the warm-up is over."""
        self.args = args
        self.compile_workers = compile_workers
        self.config = config
        self.tp = tp or TPRank()
        self.device = torch.device(args.resolved_device())
        # Triton's, Inductor's and FlashInfer's caches under the compile cache root before any
        # kernel compiles (and before the attention backend imports FlashInfer, which reads
        # its variable then), with graphs or without: a restart finds what its warm-up JIT-ed.
        self.cache_root = open_cache_root(Path(args.compile_cache_dir or default_cache_root()))
        point_tool_caches(self.cache_root)
        self.attention_backend_name = attention_backend_name(args, self.device.type)
        if self.attention_backend_name == "flashinfer":
            # Its import (a second) on a thread, beside the device's start and the weight
            # load, which spend their time outside the interpreter; waited for after the load.
            flashinfer_support.start_import()
        # Triton's key and driver beside the device's start and the load (FlashInfer's thread
        # imports Triton itself: not two threads importing it at once).
        triton_setup = None
        if self.device.type == "cuda" and self.attention_backend_name != "flashinfer":
            triton_setup = start_triton_setup()
        self.device_init_s = timed(self._init_device)
        init_tp(self.tp, self.device)  # before the model: its layers take their shards
        # The heads this rank holds: its attention backend and KV cache see only those.
        self.rank_config = dataclasses.replace(
            config,
            num_heads=even_shard(config.num_heads).size,
            num_kv_heads=kv_head_shard(config.num_kv_heads).size,
        )
        torch.manual_seed(args.seed)
        attn_cls = attention_backend_class(self.attention_backend_name)
        attn_cls.check_device(self.device)  # fail before loading
        self.attention_kernels = attn_cls.kernel_versions()
        self.graph_configs = resolve_graph_config(  # fail before loading
            args, self.device.type, attn_cls.graph_modes
        )
        self.compile_passes = resolve_compile_passes(args, self.graph_configs, self.device.type)
        # The weights fill beside what the start waits for meanwhile: on a first start the
        # compile-ahead block's compiles (after the graphs, below: its forwards need only the
        # parameters' shapes), else Triton's hashing thread.
        self.load_s = timed(self._construct_model)
        ahead = self._wants_compile_ahead(attn_cls)
        if not ahead:
            self.load_s += timed(self._fill_weights)
        if self.attention_backend_name == "flashinfer":
            # Before anything else imports: the custom ops' kernels import Triton, as may it.
            flashinfer_support.module()
        if triton_setup is not None:
            _wait_for(triton_setup.hashed, "hashing Triton's code")
        self.custom_ops_s = timed(self._select_custom_ops)  # with the kernels' import of triton
        self.kv_alloc_s = timed(self._allocate_kv)
        self.attn_backend = attn_cls(
            self.rank_config.num_heads, self.rank_config.num_kv_heads, config.head_dim
        )
        logger.info(
            "KV cache: %d slots, %.1f MiB; attention backend %s",
            self.num_slots,
            self.kv_cache.nbytes / 2**20,
            self.attention_backend_name,
        )
        if triton_setup is not None:
            # Before the graphs (an Inductor compile benchmarks Triton kernels) and the block.
            _wait_for(triton_setup.driver, "making Triton's driver")
        self._build_graphs()
        install_hooks()  # FlashInfer's module builds in the warm-up and captures, timed
        self.compile_ahead: CompileAheadInfo | None = None  # the warm-up's, if it runs
        start = dataclasses.replace(flashinfer_builds)
        plans = warmup_plans(self.context_length)
        try:
            if ahead:
                block = self._hand_out_compiles(plans)
                filled_s = timed(self._fill_weights)  # while the block's compiles run
                self.load_s += filled_s
                if block is not None:
                    self._finish_compile_ahead(block, filled_s)
            warmup_s = 0.0 if args.skip_warmup else self._warm_up(plans)
        finally:
            if compile_workers is not None:
                compile_workers.shutdown()
        warmed = dataclasses.replace(flashinfer_builds)
        capture_s = self._prewarm()
        # FlashInfer's builds as a part of the startup of their own, out of the two above.
        self.flashinfer_jit = flashinfer_builds.since(start)
        self.warmup_s = warmup_s - warmed.since(start).s
        self.capture_s = capture_s - flashinfer_builds.since(warmed).s
        if self.flashinfer_jit.compiled or self.flashinfer_jit.loaded:
            logger.info(
                "flashinfer JIT: %d module(s) compiled, %d loaded from its cache, in %.2f s",
                self.flashinfer_jit.compiled,
                self.flashinfer_jit.loaded,
                self.flashinfer_jit.s,
            )
        # Ready from here on: a JIT compile now is one the first requests wait for.
        self.jit_misses = JitMissLog()
        self.jit_misses.arm()
        self.ranks = gather_objects(RankInfo(self.tp.rank, os.getpid(), str(self.device)))

    # ---- setup -------------------------------------------------------------------------

    def _init_device(self) -> None:
        if self.device.type == "cuda":
            if self.tp.size > 1:  # one GPU per rank (the flag check refuses cuda:N here)
                self.device = torch.device("cuda", self.tp.rank)
            init_cuda(self.device, self.config.dtype)

    def _construct_model(self) -> None:
        self.model = construct_model(self.config, self.device)
        if puts_norms_in_products(self.args, self.device, self.tp.size):
            self.model.put_norms_in_products()  # before the fill, which folds their weights
            logger.info("the norms before QKV and gate/up run in those products")

    def _fill_weights(self) -> None:
        self.load_bytes = fill_weights(
            self.model, self.config, self.device, self.args.load_format, self.args.seed
        )
        logger.info("loaded %s (%s)", self.config.architecture, self.config.dtype)

    def _load_gb_s(self) -> float | None:
        """The load's bandwidth, to 3 significant figures (a tiny model's is a small fraction
        of a GB/s): over the whole of load_s, the model's construction on the device (a few
        milliseconds) in it. No figure for dummy weights, which read nothing."""
        if not self.load_bytes:
            return None
        return float(f"{self.load_bytes / self.load_s / 1e9:.3g}")

    def _select_custom_ops(self) -> None:
        self.skinny_launch = skinny_launch(self.args.skinny_matmul_launch, self.device)
        self.custom_ops = select_custom_ops(self.model, self.args, self.device, self.skinny_launch)

    def _allocate_kv(self) -> None:
        self.num_slots = kv_slots(self.args, self.device, self.graph_configs, self.rank_config)
        self.kv_cache = KVCache(self.rank_config, self.num_slots, self.device)
        for layer, k, v in zip(
            self.model.attention_layers(), self.kv_cache.k, self.kv_cache.v, strict=True
        ):
            layer.bind_kv_cache(k, v)
        self.context_length = min(self.config.context_length, self.num_slots - 1)
        self.req_to_token = torch.zeros(
            (self.args.max_running_requests, self.context_length),
            dtype=torch.int32,
            device=self.device,
        )
        # Each table row's latest sampled id, which later plans take their inputs from where
        # they say so (`input_from_row`: overlap launches them before the id is on the host).
        self.latest_ids = torch.zeros(
            self.args.max_running_requests, dtype=torch.int64, device=self.device
        )

    def _build_graphs(self) -> None:
        """Each phase's runner: its forward (compiled, or loaded from the cache, now) under its
        capture kind; the attention backend's static buffers sized for the captured phases."""
        self.graph_pool = GraphPool(self.device, self.args.cuda_graph_mem_fraction)
        self.compile_cache = open_compile_cache(
            self.cache_root,
            self.args,
            self.config,
            self.model,
            self.device,
            self.attention_backend_name,
            self.attention_kernels,
            self.graph_configs,
            self.custom_ops,
            self.tp,
        )
        env = RunnerEnv(
            self.model,
            self.attn_backend,
            self.req_to_token,
            self.args.max_running_requests,
            self.graph_pool,
            self.compile_cache,
            self.args,
            self.graph_configs,
            self.compile_passes,
        )
        self.phase_runners = {
            phase.mode: GraphRunner(phase, c, env) for phase, c in self.graph_configs.items()
        }
        init_attention_graph_state(self.phase_runners.values(), env)
        self.piecewise = env.piecewise  # the compiled phases' traced model, if any
        logger.info("split ops: %s", ", ".join(split_ops()))

    def _warm_up(self, plans: list[BatchPlan]) -> float:
        """Run the `warmup` plans through each phase's general path, so that what compiles on
        first use compiles now; serving sees no state of it (the table row is restored, KV
        went to the dummy slot, random state is forked). Returns the seconds it took."""
        start = time.perf_counter()
        with self._dummy_steps():
            # What still compiles at a launch now is a kernel the pool did not see: counted.
            missed = JitMissLog("in the warm-up, not compiled ahead")
            if self.compile_ahead is not None:
                missed.arm()
            for plan in plans:
                runner = self.phase_runners[plan.mode]
                batch, logits = runner.run_general(plan)
                step_result(plan, logits, next_token_ids(plan, batch, logits, runner)).wait()
            # The steps above ran one row count of decode: the skinny kernels of the others.
            skinny = warm_skinny_matmuls(self.model)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            missed.disarm()
        if self.compile_ahead is not None:
            self.compile_ahead = dataclasses.replace(
                self.compile_ahead, missed=missed.count, missed_s=round(missed.ms / 1000, 3)
            )
        seconds = time.perf_counter() - start  # each step's result was waited for
        logger.info(
            "warm-up: %d dummy steps (a prompt, a prefill over a prefix, decode, sampling, "
            "logprobs) and %d skinny matmul launches in %.2f s (--skip-warmup skips it)",
            len(plans),
            skinny,
            seconds,
        )
        return seconds

    @contextmanager
    def _dummy_steps(self) -> Iterator[None]:
        """Around steps that serving must not see: no autograd, the random state forked, the
        warm-up's table row restored after (their KV goes to the dummy slot)."""
        row = self.req_to_token[WARMUP_ROW].clone()
        with (
            torch.inference_mode(),
            torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []),
        ):
            yield
            self.req_to_token[WARMUP_ROW].copy_(row)

    def _wants_compile_ahead(self, attn_cls: type[AttentionBackend]) -> bool:
        """Whether this start compiles the warm-up's Triton kernels ahead, side by side: on
        CUDA, where the attention backend allows it, `--compile-threads` is not 0, the
        warm-up runs, and on a first start (Triton's disk cache empty)."""
        args = self.args
        if self.device.type != "cuda" or args.compile_threads == 0 or args.skip_warmup:
            return False
        if not attn_cls.compiles_ahead:
            return False
        cached = disk_cache_entries()
        if self.tp.size > 1:
            # Rank 0's answer on every rank: the block's forwards hold collectives, which all
            # must run or none (a rank whose cache differs only loads, or compiles at launch).
            cached = broadcast_object(cached if self.tp.rank == 0 else None)
        if cached:
            logger.info(
                "compile ahead skipped: Triton's disk cache holds %d kernel(s) already (a warm "
                "start; one it lacks compiles at its launch and is logged)",
                cached,
            )
        return not cached

    def _hand_out_compiles(self, plans: list[BatchPlan]) -> AheadBlock | None:
        """The compile-ahead block's first step (`srt.compilation.triton_ahead`): the warm-up's
        forwards and skinny launches once, on the parameters before they are filled, every
        Triton launch a compile on a pool (what they return is discarded). None if it fails:
        the warm-up then compiles each kernel at its first launch, as without it."""
        threads = self.args.compile_threads
        threads = usable_cpus() if threads is None else threads
        self.ahead_began = time.time()
        block = AheadBlock(self.device, threads, workers=self.compile_workers)
        try:
            with self._dummy_steps(), block.launching(), self.model.first_layer_only():
                # Decode first: its attention kernel is the longest compile (r22, r25: 1.5-1.9
                # s on a worker). One layer each: the prefill's extend kernel, whose compile
                # ends the block, is then handed out sooner (r35b: at 0.37 s, not 0.59).
                for plan in sorted(plans, key=lambda p: p.forward_mode != ForwardMode.DECODE):
                    runner = self.phase_runners[plan.mode]
                    batch, logits = runner.run_general(plan)
                    # A greedy plan's argmax kernels; a sampled plan's ids would index what
                    # the launches that did not run left in memory, so it is not sampled.
                    if not plan.temperatures.any():
                        next_token_ids(plan, batch, logits, runner)
                warm_skinny_matmuls(self.model)
        except Exception as e:
            block.finish()  # what was handed out still lands in the kernels' caches
            # The message, not the exception: a log record holding it would hold its frames
            # (this runner, its model and KV cache) as long as a handler keeps the record.
            logger.warning(
                "compiling the warm-up's kernels ahead failed (%s: %s): each compiles at its "
                "first launch",
                type(e).__name__,
                str(e),
            )
            return None
        return block

    def _finish_compile_ahead(self, block: AheadBlock, beside_s: float) -> None:
        """The block's second step: wait for its compiles, which ran beside `beside_s` seconds
        of the start's own work (the weight fill), and report what bounded it."""
        ahead = block.finish()
        workers = self.compile_workers
        processes = workers.processes if workers is not None else 0
        # When they were all ready and when the block began, from their start: a block that
        # began before they were ready waited for them.
        ready_s = workers.ready_after_s() if workers is not None else None
        began_s = self.ahead_began - workers.started_at if workers is not None else None
        self.compile_ahead = CompileAheadInfo(
            ahead.threads,
            ahead.kernels,
            ahead.failed + ahead.unfinished,
            round(ahead.forwards_s + ahead.waited_s, 3),
            processes=processes,
            in_processes=ahead.on_workers,
            processes_ready_s=round(ready_s, 3) if ready_s is not None else None,
            began_s=round(began_s, 3) if began_s is not None else None,
            forwards_s=round(ahead.forwards_s, 3),
            longest_process_s=round(ahead.longest_worker_s, 3),
            longest_process_kernel=ahead.longest_worker_kernel,
            processes_s=round(ahead.worker_s, 3),
            longest_thread_s=round(ahead.longest_thread_s, 3),
            beside_s=round(beside_s, 3),
            span_s=round(ahead.seconds, 3),
            last_kernel=ahead.last_kernel,
            last_handed_s=round(ahead.last_handed_s, 3),
            last_done_s=round(ahead.last_done_s, 3),
        )
        left = ahead.failed + ahead.unfinished
        failed = f", {left} failed or unfinished (compiled at their launch)" if left else ""
        where = ""
        if began_s is not None:
            ready = f"{ready_s:.2f} s after their start" if ready_s is not None else "not ready"
            where = (
                f" ({ahead.on_workers} in {processes} worker processes, ready {ready}, the "
                f"block began {began_s:.2f} s after; the longest compile "
                f"there {ahead.longest_worker_s:.2f} s ({ahead.longest_worker_kernel}), "
                f"{ahead.worker_s:.2f} s in all)"
            )
        logger.info(
            "compiled ahead: %d Triton kernel specialisation(s) on %d thread(s)%s in %.2f s, "
            "%.2f s of them beside the weight fill (its forwards %.2f s, then waited %.2f s; "
            "the longest on a thread %.2f s; the last to end %s, handed out at %.2f s, ended "
            "at %.2f s)%s",
            ahead.kernels,
            ahead.threads,
            where,
            ahead.seconds,
            beside_s,
            ahead.forwards_s,
            ahead.waited_s,
            ahead.longest_thread_s,
            ahead.last_kernel,
            ahead.last_handed_s,
            ahead.last_done_s,
            failed,
        )

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

    # ---- steps -------------------------------------------------------------------------

    def make_forward_batch(self, plan: BatchPlan) -> ForwardBatch:
        """`plan` on the device, unpadded, its table writes applied (for tools and tests that
        run the model themselves)."""
        return upload_step(plan, self.req_to_token, self.latest_ids)

    def forward_logits(self, plan: BatchPlan) -> torch.Tensor:
        """Logits [B, V] of each request's last token, through the phase's runner (valid
        until the next call: a captured phase returns a view of its static output)."""
        return self.phase_runners[plan.mode].run(plan, self.latest_ids)[1]

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
        runner = self.phase_runners[plan.mode]
        self.jit_misses.step = runner.phase.mode, plan.batch_size, plan.num_tokens
        batch, logits = runner.run(plan, self.latest_ids)
        next_ids = next_token_ids(plan, batch, logits, runner)
        # A row whose prompt is not done yet gets an id no plan reads: its first decode
        # follows the step that samples its real first token.
        b = plan.batch_size
        self.latest_ids.index_copy_(0, batch.req_pool_indices[:b], next_ids[:b])
        return step_result(plan, logits, next_ids)

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

    def info(self) -> RunnerInfo:
        return RunnerInfo(
            device=str(self.device),
            dtype=str(self.config.dtype).removeprefix("torch."),
            attention_backend=self.attention_backend_name,
            kv_slots=self.num_slots - 1,
            kv_cache_bytes=self.kv_cache.nbytes,
            context_length=self.context_length,
            tp_size=self.tp.size,
            tp_ranks=tuple(self.ranks),
            device_init_s=round(self.device_init_s, 3),
            load_s=round(self.load_s, 3),
            load_bytes=self.load_bytes,
            load_gb_s=self._load_gb_s(),
            custom_ops_s=round(self.custom_ops_s, 3),
            kv_alloc_s=round(self.kv_alloc_s, 3),
            warmup_s=round(self.warmup_s, 3),
            capture_s=round(self.capture_s, 3),
            flashinfer_jit=self.flashinfer_jit,
            compile_ahead=self.compile_ahead,
            jit_misses=self.jit_misses.info(),
            graph_pool=self.graph_pool.info(),
            compile=self.piecewise.info()
            if self.piecewise is not None
            else CompileInfo.none(split_ops()),
            custom_ops=custom_ops_info(self.custom_ops),
            skinny_matmul_launch=self.skinny_launch,
            graphs={p.value: self.phase_runners[p.mode].info() for p in self.graph_configs},
        )
