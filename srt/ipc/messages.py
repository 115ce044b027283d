"""Messages between the processes: small dataclasses, token ids as numpy arrays; what crosses
per step (a plan, a result, a step's outputs) is a few arrays, never a Python object per token.

Each message derives from the direction it travels in, and each channel (`channels.py`) takes
only its direction's messages:

    ToScheduler   tokenizer -> scheduler   GenerateReq, GenerateReqs, AbortReq, FlushCacheReq,
                                           InfoReq, ProfileReq
    ToRunner      scheduler -> runner      BatchPlan, InfoReq, ProfileReq (passed on)
    FromRunner    runner -> scheduler      RunnerReady, BatchResult, RunnerInfoReply,
                                           ProfileReply
    ToTokenizer   scheduler -> tokenizer   StepOutputs, Replies

With several tokenizer workers (--tokenizer-worker-num), each message to the scheduler names
the worker that sent it (`tokenizer_worker`): the answers and a request's outputs go back to
that worker alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain, compress

import numpy as np

from srt.batch_layout import ForwardMode
from srt.ipc.array_pickle import PackedArrays
from srt.ipc.reports import ProfileOutcome, RunnerInfo, SchedulerInfo, TimelineSummary
from srt.sampling_params import SamplingParams


class ToScheduler:
    """A message to the scheduler, from a tokenizer worker."""

    tokenizer_worker: int  # the sender: answers go back to it


class ToRunner:
    """A message to the model runner, from the scheduler."""


class FromRunner:
    """A message from the model runner, to the scheduler."""


class ToTokenizer:
    """A message to the tokenizer process, from the scheduler."""


@dataclass
class GenerateReq(ToScheduler):
    """tokenizer -> scheduler: a tokenized request."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    tokenizer_worker: int = 0  # which one sent it, and gets its outputs


@dataclass
class GenerateReqs(ToScheduler):
    """tokenizer -> scheduler: the sequences of one call (a batch of prompts, n > 1) in one
    message, so that they are admitted in the same turn and prefilled together, as a client
    that sends them at once expects (one message each could arrive spread over turns)."""

    reqs: list[GenerateReq]
    tokenizer_worker: int = 0


@dataclass
class AbortReq(ToScheduler):
    rid: str
    tokenizer_worker: int = 0


@dataclass
class FlushCacheReq(ToScheduler):
    tokenizer_worker: int = 0


@dataclass
class BatchPlan(PackedArrays, ToRunner):
    """scheduler -> runner: everything one forward step needs, prepared on the host.

    Tokens of the batch's requests are concatenated in request order. `table_*` are the
    writes to apply to the runner's request-to-token table before the step.
    """

    forward_mode: int  # ForwardMode
    input_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    out_cache_loc: np.ndarray  # [T] int32
    req_pool_indices: np.ndarray  # [B] int32
    prefix_lens: np.ndarray  # [B] int32
    extend_lens: np.ndarray  # [B] int32
    table_rows: np.ndarray  # [W] int32
    table_cols: np.ndarray  # [W] int32
    table_slots: np.ndarray  # [W] int32
    temperatures: np.ndarray  # [B] float32
    top_ps: np.ndarray  # [B] float32
    top_ks: np.ndarray  # [B] int64
    min_ps: np.ndarray  # [B] float32
    seeds: np.ndarray  # [B] int64
    return_logprob: bool = False  # any request of the batch asked for logprobs
    top_logprobs_num: int = 0  # the most any request of the batch asked for
    step: int = 0
    # [T] int32: where a token's input id is its request's latest sampled id that a step
    # still in flight produces (overlap: the id stays on the device), the request's table
    # row, whose latest id the runner keeps; -1 where the id is in `input_ids`. None: every
    # id is there.
    input_from_row: np.ndarray | None = None

    @classmethod
    def greedy(
        cls,
        mode: int,
        *,
        input_ids: np.ndarray,
        positions: np.ndarray,
        out_cache_loc: np.ndarray,
        req_pool_indices: np.ndarray,
        prefix_lens: np.ndarray,
        extend_lens: np.ndarray,
        table: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> BatchPlan:
        """A plan whose requests all sample greedily, without logprobs (the runner's own
        dummy steps, the tools'); `table`: its (rows, cols, slots) table writes, if any."""
        b = len(req_pool_indices)
        none = np.zeros(0, np.int32)
        rows, cols, slots = table if table is not None else (none, none, none)
        return cls(
            forward_mode=int(mode),
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=req_pool_indices,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            table_rows=rows,
            table_cols=cols,
            table_slots=slots,
            temperatures=np.zeros(b, np.float32),
            top_ps=np.ones(b, np.float32),
            top_ks=np.ones(b, np.int64),
            min_ps=np.zeros(b, np.float32),
            seeds=np.zeros(b, np.int64),
        )

    @property
    def mode(self) -> ForwardMode:
        return ForwardMode(self.forward_mode)

    @property
    def batch_size(self) -> int:
        return len(self.req_pool_indices)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class BatchResult(PackedArrays, FromRunner):
    """runner -> scheduler: one sampled token per request of the plan."""

    next_token_ids: np.ndarray  # [B] int64
    logprobs: np.ndarray | None = None  # [B] float32, when the plan asked
    top_logprob_vals: np.ndarray | None = None  # [B, N]
    top_logprob_ids: np.ndarray | None = None  # [B, N]
    step: int = 0


@dataclass(slots=True)  # slots: one is made per request per step, in the main process
class TokenOutput:
    """scheduler -> tokenizer: what one request produced in one step."""

    rid: str
    new_token_ids: list[int]
    finished_reason: str | None = None  # "stop", "length", "abort"
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    error: str | None = None


@dataclass
class StepOutputs(PackedArrays, ToTokenizer):
    """scheduler -> tokenizer, one per step: every request's `TokenOutput` of the step, packed
    into arrays (tokens of all requests concatenated, `counts` per request)."""

    rids: list[str]
    counts: np.ndarray  # [R] int32, new tokens per request
    token_ids: np.ndarray  # [N] int32
    finished_reasons: list[str | None]
    matched_stops: list[int | str | None]
    lengths: np.ndarray  # [R, 3] int32: prompt, completion and cached tokens
    logprobs: np.ndarray  # [N] float32, empty when no request of the step asked
    has_logprobs: np.ndarray  # [R] bool, the requests that asked
    top_counts: np.ndarray  # [R] int32, top logprobs per token each request asked for
    top_ids: np.ndarray  # [N, K] int32, K the most any request asked (padded)
    top_vals: np.ndarray  # [N, K] float32
    errors: list[str | None]

    @classmethod
    def pack(cls, outputs: list[TokenOutput]) -> StepOutputs:
        packed = StepOutputsBuilder()
        packed.add(
            [o.rid for o in outputs],
            [len(o.new_token_ids) for o in outputs],
            list(chain.from_iterable(o.new_token_ids for o in outputs)),
            [o.finished_reason for o in outputs],
            [o.matched_stop for o in outputs],
            [o.prompt_tokens for o in outputs],
            [o.completion_tokens for o in outputs],
            [o.cached_tokens for o in outputs],
            {
                j: (o.logprobs, o.top_logprobs)
                for j, o in enumerate(outputs)
                if o.logprobs or o.top_logprobs
            },
            [o.error for o in outputs],
        )
        return packed.build()

    def __len__(self) -> int:
        """How many requests' outputs it carries."""
        return len(self.rids)

    def take(self, rows: np.ndarray) -> StepOutputs:
        """The outputs of the requests where the bool mask `rows` holds, in order: their own
        message (one per tokenizer worker)."""
        keep = rows.tolist()
        tokens = np.repeat(rows, self.counts)
        return StepOutputs(
            rids=list(compress(self.rids, keep)),
            counts=self.counts[rows],
            token_ids=self.token_ids[tokens],
            finished_reasons=list(compress(self.finished_reasons, keep)),
            matched_stops=list(compress(self.matched_stops, keep)),
            lengths=self.lengths[rows],
            logprobs=self.logprobs[tokens] if len(self.logprobs) else self.logprobs,
            has_logprobs=self.has_logprobs[rows],
            top_counts=self.top_counts[rows],
            top_ids=self.top_ids[tokens],
            top_vals=self.top_vals[tokens],
            errors=list(compress(self.errors, keep)),
        )

    def unpack(self) -> list[TokenOutput]:
        """The per-request outputs again, for routing to each request's queue."""
        out = []
        ends = np.cumsum(self.counts).tolist()
        token_ids = self.token_ids.tolist()
        logprobs = self.logprobs.tolist()
        has_logprobs = self.has_logprobs.tolist()
        lengths = self.lengths.tolist()
        top_counts = self.top_counts.tolist()
        start = 0
        for i, rid in enumerate(self.rids):
            end = ends[i]
            top: list[list[tuple[int, float]]] = []
            if top_counts[i]:
                ids = self.top_ids[start:end, : top_counts[i]].tolist()
                vals = self.top_vals[start:end, : top_counts[i]].tolist()
                top = [list(zip(a, b, strict=True)) for a, b in zip(ids, vals, strict=True)]
            out.append(
                TokenOutput(
                    rid=rid,
                    new_token_ids=token_ids[start:end],
                    finished_reason=self.finished_reasons[i],
                    matched_stop=self.matched_stops[i],
                    prompt_tokens=lengths[i][0],
                    completion_tokens=lengths[i][1],
                    cached_tokens=lengths[i][2],
                    logprobs=logprobs[start:end] if has_logprobs[i] else [],
                    top_logprobs=top,
                    error=self.errors[i],
                )
            )
            start = end
        return out


class StepOutputsBuilder:
    """A step's `StepOutputs`, built column by column: the scheduler adds its requests'
    outputs here as it processes a step's sampled ids, so that no `TokenOutput` per request
    per step is made only to be packed (`StepOutputs.pack` builds through it too). `add`
    takes whole columns: a call per request would cost more than the columns' own work at a
    large batch."""

    def __init__(self) -> None:
        self.rids: list[str] = []
        self.counts: list[int] = []
        self.token_ids: list[int] = []
        self.finished_reasons: list[str | None] = []
        self.matched_stops: list[int | str | None] = []
        self.prompt_tokens: list[int] = []
        self.completion_tokens: list[int] = []
        self.cached_tokens: list[int] = []
        self.errors: list[str | None] = []
        # (row, logprobs, top logprobs) of the few requests that asked for logprobs: filled
        # in at `build`, so that the others cost nothing for them.
        self.with_logprobs: list[tuple[int, list[float], list[list[tuple[int, float]]]]] = []

    def add(
        self,
        rids: list[str],
        counts: list[int],
        token_ids: list[int],
        finished_reasons: list[str | None],
        matched_stops: list[int | str | None],
        prompt_tokens: list[int],
        completion_tokens: list[int],
        cached_tokens: list[int],
        logprobs: dict[int, tuple[list[float], list[list[tuple[int, float]]]]],
        errors: list[str | None] | None = None,
    ) -> None:
        """The outputs of the requests `rids`, each of its `counts` new ids (concatenated in
        `token_ids`); `logprobs` holds the logprobs and top logprobs of the new ids of those
        that have any, by their index in `rids`; `errors` None: none."""
        first = len(self.rids)
        for j, (lps, top) in logprobs.items():
            self.with_logprobs.append((first + j, lps, top))
        self.rids += rids
        self.counts += counts
        self.token_ids += token_ids
        self.finished_reasons += finished_reasons
        self.matched_stops += matched_stops
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.cached_tokens += cached_tokens
        self.errors += errors if errors is not None else [None] * len(rids)

    def build(self) -> StepOutputs:
        r, n = len(self.rids), len(self.token_ids)
        counts = np.array(self.counts, np.int32)
        has_logprobs = np.zeros(r, bool)
        top_counts = np.zeros(r, np.int32)
        for row, lps, top in self.with_logprobs:
            has_logprobs[row] = bool(lps)
            top_counts[row] = len(top[0]) if top else 0
        logprobs = np.zeros(n if has_logprobs.any() else 0, np.float32)
        k = int(top_counts.max()) if self.with_logprobs else 0
        top_ids, top_vals = np.zeros((n, k), np.int32), np.zeros((n, k), np.float32)
        starts = (np.cumsum(counts) - counts).tolist() if self.with_logprobs else []
        for row, lps, top in self.with_logprobs:
            start = starts[row]
            logprobs[start : start + len(lps)] = lps
            for j, pairs in enumerate(top):
                for col, (t, v) in enumerate(pairs):
                    top_ids[start + j, col], top_vals[start + j, col] = t, v
        lengths = (self.prompt_tokens, self.completion_tokens, self.cached_tokens)
        return StepOutputs(
            rids=self.rids,
            counts=counts,
            token_ids=np.array(self.token_ids, np.int32),
            finished_reasons=self.finished_reasons,
            matched_stops=self.matched_stops,
            lengths=np.array(lengths, np.int32).T.copy(),
            logprobs=logprobs,
            has_logprobs=has_logprobs,
            top_counts=top_counts,
            top_ids=top_ids,
            top_vals=top_vals,
            errors=self.errors,
        )


@dataclass
class FlushCacheOutput:
    """scheduler -> tokenizer: the answer to a FlushCacheReq."""

    success: bool


@dataclass
class InfoReq(ToScheduler, ToRunner):
    """tokenizer -> scheduler -> runner: ask for live state (server info, metrics)."""

    req_id: int
    # Summarise each process's step timeline over the steps begun since this
    # `time.perf_counter()` value (None: every step it keeps).
    timeline_since: float | None = None
    tokenizer_worker: int = 0


@dataclass
class RunnerInfoReply(FromRunner):
    """The runner's answer to an InfoReq, after the results of the steps before it."""

    info: RunnerInfo
    timeline: TimelineSummary


@dataclass
class InfoOutput:
    """The scheduler's answer to an InfoReq: its own state and the runner's, each with its
    step timeline over the window asked for."""

    req_id: int
    scheduler: SchedulerInfo
    scheduler_timeline: TimelineSummary
    runner: RunnerInfo
    runner_timeline: TimelineSummary


@dataclass
class ProfileReq(ToScheduler, ToRunner):
    """tokenizer -> scheduler -> runner: start profiling the runner's next steps (`start`:
    at most `num_steps` of them, None: until stopped; the trace into `output_dir`, None: the
    runner's default), or stop it and say what it recorded."""

    req_id: int
    start: bool
    output_dir: str | None = None
    num_steps: int | None = None
    tokenizer_worker: int = 0


@dataclass
class ProfileReply(FromRunner):
    """The runner's answer to a ProfileReq, after the results of the steps before it."""

    outcome: ProfileOutcome


@dataclass
class ProfileOutput:
    """The scheduler's answer to a ProfileReq: the runner's."""

    req_id: int
    outcome: ProfileOutcome


# What the scheduler answers a tokenizer worker's message with, between steps.
Reply = TokenOutput | FlushCacheOutput | InfoOutput | ProfileOutput


@dataclass
class Replies(ToTokenizer):
    """The scheduler's answers to what one turn of its inbox brought: a refused request's
    error, a flush's outcome, live info, a profile's."""

    items: list[Reply]


@dataclass
class RunnerReady(FromRunner):
    """runner -> scheduler, once, before any plan: the KV cache the scheduler plans against."""

    num_slots: int
    context_length: int
    device_type: str = "cpu"  # the scheduler's --busy-poll-ms default depends on it
