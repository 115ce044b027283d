"""A request as the scheduler tracks it, a planned step's requests, and the step counters: what
the scheduler's parts (admission, KV accounting, plan building, stop checks) and the prefix
cache share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from srt.ipc.messages import BatchPlan
from srt.sampling_params import SamplingParams

NO_SLOTS = np.zeros(0, dtype=np.int32)


@dataclass(eq=False)  # identity: requests are compared in queue lookups on the hot path
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    stream: bool = False
    max_new_tokens: int = 0  # the params' own, resolved by the front end before admission
    output_ids: list[int] = field(default_factory=list)
    sent_ids: int = 0  # of output_ids, those the tokenizer side has been sent
    row: int = -1  # request-to-token table row, -1 while waiting
    # KV slots of tokens [0, kv_len): the first `num_slots` entries of a buffer that grows by
    # doubling, so a decode step appends in O(1) instead of copying the whole history.
    slot_buf: np.ndarray = field(default_factory=lambda: NO_SLOTS)
    num_slots: int = 0
    kv_len: int = 0  # tokens whose KV the steps planned so far write
    table_len: int = 0  # entries of its row the runner has been sent
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    cache_node: Any = None  # prefix-cache node locked while the request runs
    finished_reason: str | None = None
    matched_stop: int | str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # The number of the latest step planned with it: the steps in flight have it until that
    # step's result is processed (results are processed in order).
    last_step: int = 0
    # Output tokens known plus those the steps in flight will sample: counted when planned,
    # so that processing a result leaves it alone.
    planned_outputs: int = 0
    prompt_len: int = field(init=False)  # len(input_ids), which never change: read every step

    def __post_init__(self) -> None:
        self.prompt_len = len(self.input_ids)

    @property
    def slots(self) -> np.ndarray:
        return self.slot_buf[: self.num_slots]

    @slots.setter
    def slots(self, slots: np.ndarray) -> None:
        self.slot_buf, self.num_slots = slots, len(slots)

    def add_slots(self, new: np.ndarray) -> None:
        end = self._room(len(new))
        self.slot_buf[self.num_slots : end] = new
        self.num_slots = end

    def add_slot(self, slot: int) -> None:
        """One slot (a decode step's): a scalar store, cheaper than a slice's."""
        n = self.num_slots
        if n == len(self.slot_buf):
            self._room(1)  # first: it replaces the buffer
        self.slot_buf[n] = slot
        self.num_slots = n + 1

    def _room(self, n: int) -> int:
        """Grow the buffer to hold `n` more slots; where they end."""
        end = self.num_slots + n
        if end > len(self.slot_buf):
            buf = np.empty(max(end, 2 * len(self.slot_buf), 64), np.int32)
            buf[: self.num_slots] = self.slots
            self.slot_buf = buf
        return end

    @property
    def prompt_done(self) -> bool:
        return self.kv_len >= self.prompt_len

    @property
    def future_need(self) -> int:
        """KV slots this request may still allocate."""
        return self.prompt_len + self.max_new_tokens - self.num_slots


@dataclass
class ScheduledStep:
    """A planned step and, per row of its result, the request and whether it samples there
    (a prefill chunk that does not finish the prompt samples nothing)."""

    plan: BatchPlan
    reqs: list[Req]
    samples: list[bool]


@dataclass
class StepCounters:
    """What the scheduler has done since it started: its `SchedulerInfo` counters, by name."""

    prefill_steps: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0  # of the requests admitted
    generated_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    mixed_decode_tokens: int = 0  # decodes that rode along in prefill steps
