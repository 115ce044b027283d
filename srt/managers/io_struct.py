"""Messages between the processes: small dataclasses, token ids as numpy arrays."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from srt.sampling_params import SamplingParams


@dataclass
class GenerateReq:
    """tokenizer -> scheduler: a tokenized request."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    pass


@dataclass
class BatchPlan:
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

    @property
    def batch_size(self) -> int:
        return len(self.req_pool_indices)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class BatchResult:
    """runner -> scheduler: one sampled token per request of the plan."""

    next_token_ids: np.ndarray  # [B] int64
    logprobs: np.ndarray | None = None  # [B] float32, when the plan asked
    top_logprob_vals: np.ndarray | None = None  # [B, N]
    top_logprob_ids: np.ndarray | None = None  # [B, N]
    step: int = 0


@dataclass
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
class FlushCacheOutput:
    """scheduler -> tokenizer: the answer to a FlushCacheReq."""

    success: bool


@dataclass
class InfoReq:
    """tokenizer -> scheduler -> runner: ask for live state (server info, metrics)."""

    req_id: int


@dataclass
class InfoOutput:
    """scheduler -> tokenizer: the answer to an InfoReq."""

    req_id: int
    scheduler: dict
    runner: dict


@dataclass
class RunnerReady:
    """runner -> scheduler, once, before any plan: the KV cache the scheduler plans against."""

    num_slots: int
    context_length: int
