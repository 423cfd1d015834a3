"""Requests, sampling parameters and results of the single-device engine.

The engine works on token ids only; tokenization belongs to the caller.
"""

import enum
import math
import numbers
from dataclasses import dataclass, field

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes at most an unsigned 64-bit value


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off; in (0, 1]
    seed: int | None = None  # per-request generator: same seed, same tokens, whatever the batch
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's end-of-sequence ids
    # Stop strings: the request finishes once its output text contains one (the engine asks its
    # `stop_check`, which the caller that knows the tokenizer supplies; the text is not cut).
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # log p of each output token (raw model distribution)
    prompt_logprobs: bool = False  # log p of each prompt token given its prefix (first: None)
    # Score only prompt tokens at positions >= this (a continuation after its context): the
    # context before it may then come from the prefix cache. prompt_logprobs and prompt_greedy
    # cover positions [prompt_logprobs_start, len(prompt)).
    prompt_logprobs_start: int = 0

    def validate(self) -> "SamplingParams":
        """ValueError naming the field for a value of the wrong type or range: nothing that
        passes can fail in the sampler (per-row values come from user data)."""
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not is_real(value) or not math.isfinite(value):
                raise ValueError(f"{name} = {value!r} must be a finite number")
        for name in ("top_k", "max_new_tokens", "prompt_logprobs_start"):
            if not is_int(getattr(self, name)):
                raise ValueError(f"{name} = {getattr(self, name)!r} must be an integer")
        if not self.temperature >= 0:
            raise ValueError(f"temperature = {self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k} must be >= 0")
        if self.prompt_logprobs_start < 0:
            raise ValueError(f"prompt_logprobs_start = {self.prompt_logprobs_start} must be >= 0")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {self.max_new_tokens} must be >= 1")
        if self.seed is not None and not (is_int(self.seed) and 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed = {self.seed!r} must be an integer in [0, 2**64)")
        if not isinstance(self.stop_token_ids, tuple | list) or not all(
            is_int(t) for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids = {self.stop_token_ids!r} must be integers")
        if not isinstance(self.stop, tuple | list) or not all(
            isinstance(s, str) and s for s in self.stop
        ):
            raise ValueError(f"stop = {self.stop!r} must be non-empty strings")
        for name in ("ignore_eos", "logprobs", "prompt_logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} = {getattr(self, name)!r} must be true or false")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    HANDOFF = "handoff"  # prompt done; waits for room in the decode group
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(eq=False)  # a request is an entity: compared by identity (lists scan it per step)
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
    prompt_greedy: list[bool | None] = field(default_factory=list)  # token == argmax of its row
    finish_reason: str | None = None

    def problem(self, vocab_size: int, max_seq_len: int, can_stop: bool) -> str | None:
        """Why this request can never run (None if it can): bad sampling values, stop strings
        without a tokenizer (can_stop), an empty prompt, ids that are not integers of the
        vocabulary, a prompt that leaves no room in max_seq_len."""
        if not isinstance(self.sampling, SamplingParams):
            return f"sampling must be SamplingParams, got {type(self.sampling).__name__}"
        try:
            self.sampling.validate()
        except ValueError as e:
            return str(e)
        if self.sampling.stop and not can_stop:
            return "stop strings need an engine with a stop_check (a tokenizer)"
        ids = self.prompt_token_ids
        if not ids:
            return "empty prompt"
        # Plain ints (the usual case) are checked at C speed: a request is added between two
        # engine steps, and the per-token loops took ~0.5 ms per 1,024 tokens.
        plain = set(map(type, ids)) == {int}
        bad = [] if plain else [t for t in ids if not is_int(t)]
        if bad:
            return f"token id {bad[0]!r} is not an integer"
        if not plain or min(ids) < 0 or max(ids) >= vocab_size:
            bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            return f"token id {bad[0]} outside the vocabulary [0, {vocab_size})"
        if len(ids) >= max_seq_len:
            return f"prompt of {len(ids)} tokens leaves no room in max_seq_len = {max_seq_len}"
        return None

    @property
    def last_token_id(self) -> int:
        """The token a decode step feeds (read per request per step: no list is built)."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def append_token(self, tok: int, logprob: float | None, *, eos_token_ids, stop_check,
                     max_seq_len: int) -> None:  # fmt: skip
        """Add a sampled token; finish ("stop" or "length") when it ends the request.
        stop_check(stop strings, output ids) -> bool: whether the text holds one of them."""
        p = self.sampling
        self.output_token_ids.append(tok)
        if p.logprobs:
            self.output_logprobs.append(logprob)
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        if tok in stops or (p.stop and stop_check(p.stop, self.output_token_ids)):
            self.finish_reason = "stop"
        elif len(self.output_token_ids) >= p.max_new_tokens or self.num_tokens >= max_seq_len:
            self.finish_reason = "length"
        if self.finish_reason:
            self.phase = Phase.FINISHED

    def last_by_length(self, max_seq_len: int) -> bool:
        """Whether one more token ends this request by length (max_new_tokens or max_seq_len)."""
        return (len(self.output_token_ids) + 1 >= self.sampling.max_new_tokens
                or self.num_tokens + 1 >= max_seq_len)  # fmt: skip

    def result(self) -> "GenerationResult":
        p = self.sampling
        return GenerationResult(
            self.request_id,
            self.prompt_token_ids,
            self.output_token_ids,
            self.finish_reason,
            output_logprobs=self.output_logprobs if p.logprobs else None,
            prompt_logprobs=self.prompt_logprobs if p.prompt_logprobs else None,
            prompt_greedy=self.prompt_greedy if p.prompt_logprobs else None,
        )

    def restart(self) -> None:
        """Drop all progress (a retracted request runs again from its prompt)."""
        self.phase, self.num_computed, self.finish_reason = Phase.WAITING, 0, None
        self.output_token_ids, self.output_logprobs, self.prompt_logprobs = [], [], []
        self.prompt_greedy = []


@dataclass(frozen=True, slots=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "error"
    output_logprobs: list[float] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_greedy: list[bool | None] | None = None  # with prompt_logprobs: each token the argmax
    error: str | None = None
