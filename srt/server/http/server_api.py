"""The server's own endpoints: health, live info, Prometheus metrics, flushing the prefix cache,
profiling the model runner (SGLang's `/start_profile` and `/stop_profile`)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from srt.ipc.reports import TimelineSummary, jsonable
from srt.process import process_cpu_s
from srt.server.http.common import OrjsonResponse, error_response
from srt.server.tokenizer_manager import TokenizerManager

HEALTH_PATH = "/health"  # open without the API key, for load balancers


class ProfileRequest(BaseModel):
    """`/start_profile`'s body, optional (SGLang's names; its other fields are refused, not
    ignored): the trace's directory (default `$SRT_PROFILE_DIR`, else the temporary one) and
    the most steps to record (default: until `/stop_profile`)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    output_dir: str | None = None
    num_steps: int | None = Field(default=None, ge=1)


def internal_state(scheduler_timeline: TimelineSummary) -> dict[str, Any]:
    """What SGLang's clients read from `internal_states` after a run (one entry per data
    parallel rank; srt has one): no speculative decoding, so no accept length; the generation
    throughput over the scheduler's last steps (its timeline's decode steps)."""
    decode = scheduler_timeline.kinds.get("decode")
    throughput = (
        round(decode.steps * decode.requests_mean * 1000 / decode.ms_total, 2)
        if decode is not None and decode.ms_total > 0
        else 0.0
    )
    return {"avg_spec_accept_length": None, "last_gen_throughput": throughput}


def tokenizer_workers_cpu_s(manager: TokenizerManager) -> dict[str, float]:
    """Each tokenizer process's CPU seconds so far, by its name in the startup record: one
    worker answers, and a benchmark needs all of their shares."""
    processes = manager.startup.processes if manager.startup else {}
    seconds = {}
    for name, entry in processes.items():
        cpu_s = process_cpu_s(entry.pid) if name.startswith("tokenizer") else None
        if cpu_s is not None:
            seconds[name] = round(cpu_s, 3)
    return seconds


def server_router(manager: TokenizerManager) -> APIRouter:
    router = APIRouter()

    @router.get(HEALTH_PATH)
    async def health() -> Response:
        if manager.ready:
            return OrjsonResponse({"status": "ok"})
        return OrjsonResponse({"status": manager.failure or "starting"}, status_code=503)

    @router.get("/get_server_info")
    async def server_info(timeline_since: float | None = None) -> dict[str, Any]:
        """`timeline_since`: summarise the step timelines over the steps begun since this
        value of `clock_s` (an earlier answer's), e.g. those of one benchmark run."""
        info = await manager.get_info(timeline_since)
        args = dataclasses.asdict(manager.args)
        if args["api_key"]:
            args["api_key"] = "<redacted>"
        cfg = manager.model_config
        return {
            "server_args": args,
            "model": {
                "name": manager.model_name,
                "path": str(cfg.path),
                "architecture": cfg.architecture,
                "num_layers": cfg.num_layers,
                "vocab_size": cfg.vocab_size,
                "context_length": manager.context_length,
            },
            **(jsonable(manager.startup) if manager.startup else {}),
            "runner": {**jsonable(info.runner), "timeline": jsonable(info.runner_timeline)},
            "graphs": jsonable(info.runner.graphs),
            "compile": jsonable(info.runner.compile),
            "scheduler": {
                **jsonable(info.scheduler),
                "timeline": jsonable(info.scheduler_timeline),
            },
            "tokenizer": {
                "timeline": jsonable(manager.timeline.summary(timeline_since)),
                # Its requests' marks (arrived, sent, first token, finished) as a timeline of
                # calls begun in the window: median milliseconds between them.
                "requests": jsonable(manager.requests.summary(timeline_since)),
                "worker": manager.worker,  # the tokenizer worker that answered
                "workers_cpu_s": tokenizer_workers_cpu_s(manager),
            },
            "internal_states": [internal_state(info.scheduler_timeline)],
            # The timelines' clock (`time.perf_counter()`, one clock for all the processes).
            "clock_s": time.perf_counter(),
        }

    @router.get("/metrics")
    async def metrics() -> Response:
        info = await manager.get_info()
        body = manager.metrics.render(
            info.scheduler, info.runner, manager.startup.startup_s if manager.startup else 0.0
        )
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @router.post("/flush_cache")
    async def flush_cache() -> Response:
        if await manager.flush_cache():
            return OrjsonResponse({"success": True})
        return error_response(400, "cannot flush the cache while requests are in flight")

    @router.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile(body: ProfileRequest | None = None) -> Response:
        """Profile the runner's next steps; the answer names the trace file."""
        req = body or ProfileRequest()
        outcome = await manager.profile(True, req.output_dir, req.num_steps)
        if outcome.error is not None:
            return error_response(400, outcome.error)
        return OrjsonResponse(jsonable(outcome))

    @router.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile() -> Response:
        """End the profile (or take the last one's, if it ended by its step count): its trace
        file and per-step summary."""
        return OrjsonResponse(jsonable(await manager.profile(False)))

    return router
