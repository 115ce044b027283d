"""The runner ceiling of a served run: the output tokens per second the model runner alone
(`srt.bench.one_batch`, no scheduler, no HTTP) delivers on the run's work, measured on the same
machine in the same call.

A served run of mean decode batch B (the scheduler's mean decode requests over the run) and
`output_len` tokens a request does, per B requests, one prefill of B prompts and `output_len`
decode steps at batch B. The runner takes `prefill_ms(B)` for the first and `decode_ms(B)`
(the overlapped step, as the server runs it) for each of the others, so

    ceiling tok/s = B * output_len * 1000 / (prefill_ms(B) + output_len * decode_ms(B))

with both figures interpolated linearly between the batch sizes one_batch measured (the nearest
measured one outside them). The prefill is one_batch's: B prompts of `--input-len` tokens in
one forward, where the server may split them over several prefill steps (`--max-prefill-tokens`),
meets shorter prompts with a `--range-ratio` below 1 and, with a shared prefix, computes only
the rest of each prompt.

This module reads one_batch's JSON lines only, and runs one_batch as a subprocess: it imports
neither torch nor the runtime, so the serving bench's client processes stay light.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

# The fields of a one_batch row that say which configuration it measured.
CONFIG_KEYS = (
    "model",
    "dtype",
    "device",
    "tp_size",
    "attention_backend",
    "prefill_backend",
    "decode_backend",
    "enable_torch_compile",
    "tc_compiler",
    "custom_ops",
)
# The fields of a row the ceiling reads, kept in the serving bench's JSON.
FIGURE_KEYS = (
    "batch_size",
    "input_len",
    "output_len",
    "prefill_ms",
    "decode_ms_overlapped",
    "decode_ms_per_step",
)


@dataclasses.dataclass
class RunnerFigures:
    """one_batch's rows of one configuration at one input length, one per batch size in
    increasing order, and where they come from; or, with no rows, why there are none."""

    source: str | None
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    error: str | None = None

    def ceiling(self, batch: float | None, output_len: int) -> dict[str, Any]:
        """The ceiling of a run of mean decode batch `batch` and `output_len` tokens a request,
        with its inputs; `tok_s` None and `missing` the reason when it cannot be computed."""
        if not self.rows:
            return {"tok_s": None, "missing": self.error or "no runner figures"}
        if not batch:
            return {"tok_s": None, "missing": "the server took no decode steps in the run"}
        return ceiling(self.rows, batch, output_len)

    def json(self) -> dict[str, Any]:
        config = {k: self.rows[0].get(k) for k in CONFIG_KEYS} if self.rows else None
        return {
            "source": self.source,
            "config": config,
            "rows": [{k: r.get(k) for k in FIGURE_KEYS} for r in self.rows],
            "error": self.error,
        }


def ceiling(rows: Sequence[dict[str, Any]], batch: float, output_len: int) -> dict[str, Any]:
    """The runner ceiling (tok/s) at mean decode batch `batch`, from one_batch `rows` of
    increasing batch size, and the figures it was computed from."""
    sizes = [r["batch_size"] for r in rows]
    prefill_ms = float(np.interp(batch, sizes, [r["prefill_ms"] for r in rows]))
    decode_ms = float(np.interp(batch, sizes, [r["decode_ms_overlapped"] for r in rows]))
    return {
        "tok_s": round(batch * output_len * 1000 / (prefill_ms + output_len * decode_ms), 1),
        "batch": batch,
        "output_len": output_len,
        "input_len": rows[0]["input_len"],
        "prefill_ms": round(prefill_ms, 3),
        "decode_ms": round(decode_ms, 4),
        "measured_batches": sizes,
    }


def read_rows(path: Path, input_len: int) -> list[dict[str, Any]]:
    """The one_batch rows of `path` (JSON lines) at `input_len` with the figures the ceiling
    needs, one per batch size (a later line wins), in increasing batch size. Raises ValueError
    when there are none, or when they measured more than one configuration."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [
        r
        for r in rows
        if "decode_backend" in r  # one_batch's, not hf_baseline's
        and r.get("input_len") == input_len
        and r.get("prefill_ms")
        and r.get("decode_ms_overlapped")
    ]
    if not rows:
        raise ValueError(
            f"{path}: no one_batch rows at input length {input_len} with prefill and "
            "overlapped decode figures"
        )
    configs = {json.dumps({k: r.get(k) for k in CONFIG_KEYS}, sort_keys=True) for r in rows}
    if len(configs) > 1:
        raise ValueError(
            f"{path}: the rows at input length {input_len} measured {len(configs)} "
            "configurations; give the rows of the server's configuration alone"
        )
    by_batch = {r["batch_size"]: r for r in rows}
    return [by_batch[b] for b in sorted(by_batch)]


def read(path: Path, input_len: int) -> RunnerFigures:
    """The runner figures of a one_batch results file (`read_rows`)."""
    return RunnerFigures(str(path), read_rows(path, input_len))


def measure(
    flags: Sequence[str],
    batch_sizes: Sequence[int],
    input_len: int,
    output_len: int,
    workdir: Path,
    timeout_s: float,
) -> RunnerFigures:
    """Run `python -m srt.bench.one_batch FLAGS` (the server's flags: the same model, dtype,
    load format, graph backends and attention backend) for `batch_sizes` at `input_len` and
    `output_len`, its results and log in `workdir`. A one_batch that fails gives figures
    without rows, the end of its log as the error: the bench then reports no ceiling."""
    results, log = workdir / "one_batch.jsonl", workdir / "one_batch.log"
    cmd = [
        sys.executable,
        "-m",
        "srt.bench.one_batch",
        *flags,
        "--batch-size",
        *map(str, batch_sizes),
        "--input-len",
        str(input_len),
        "--output-len",
        str(output_len),
        "--result-file",
        str(results),
    ]
    source = "srt.bench.one_batch in this call"
    with open(log, "wb") as out:
        try:
            code = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            return RunnerFigures(source, error=f"one_batch ran past {timeout_s} s")
    if code != 0:
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-5:])
        return RunnerFigures(source, error=f"one_batch exited with {code}: {tail}")
    try:
        return RunnerFigures(source, read_rows(results, input_len))
    except (OSError, ValueError) as e:  # e.g. an output length of 1: no decode step to time
        return RunnerFigures(source, error=str(e))
