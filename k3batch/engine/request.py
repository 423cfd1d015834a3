"""Requests, sampling parameters and results of the single-device engine.

The engine works on token ids only; tokenization belongs to the caller.
"""

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off; in (0, 1]
    seed: int | None = None  # per-request generator: same seed, same tokens, whatever the batch
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's end-of-sequence ids
    ignore_eos: bool = False
    logprobs: bool = False  # log p of each output token (raw model distribution)
    prompt_logprobs: bool = False  # log p of each prompt token given its prefix (first: None)

    def validate(self) -> "SamplingParams":
        if not self.temperature >= 0:
            raise ValueError(f"temperature = {self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k} must be >= 0")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {self.max_new_tokens} must be >= 1")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    HANDOFF = "handoff"  # prompt done; waits for room in the decode group
    DECODE = "decode"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # engine-owned state
    phase: Phase = Phase.WAITING
    num_computed: int = 0  # tokens whose state is in the cache
    cuts: tuple[int, ...] = ()  # prompt positions where a prefill chunk must end
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def restart(self) -> None:
        """Drop all progress (a retracted request runs again from its prompt)."""
        self.phase, self.num_computed, self.finish_reason = Phase.WAITING, 0, None
        self.output_token_ids, self.output_logprobs, self.prompt_logprobs = [], [], []


@dataclass(frozen=True, slots=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "error"
    output_logprobs: list[float] | None = None
    prompt_logprobs: list[float | None] | None = None
    error: str | None = None
