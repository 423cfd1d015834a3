"""Engine: requests in, tokens out, on one device or over Ray actor groups.

Contract: the engine knows nothing of text, and nothing of where the model runs (runners, see
`runner.py`). `add_request` queues token ids; each `step` prefills (up to `runner.depth`
batches of prompt chunks submitted back to back, so that a pipeline's stages all work) and
decodes one token for every request whose prompt is done: one after the other on a single
runner, at the same time when a separate decode runner (a TP/DCP group) takes requests by
handoff. It returns the requests that finished. Each request owns one cache slot (KDA states, conv states, MLA
latents) from admission to finish. Admission is bounded by the number of slots; a prompt chunk
is at most `chunk_size` tokens and a prefill batch at most `max_batch_tokens` tokens.
"""

from collections import deque
from dataclasses import dataclass

import torch

from k3batch.engine.request import GenerationResult, Phase, Request, SamplingParams
from k3batch.engine.runner import LocalRunner
from k3batch.engine.sampler import make_generator, sample
from k3batch.model.forward_batch import ForwardBatch


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    max_num_seqs: int = 8  # cache slots = requests in flight
    max_seq_len: int = 4096  # prompt + output tokens per request
    chunk_size: int = 256  # prompt tokens per request per prefill step
    max_batch_tokens: int = 2048  # tokens per prefill step

    def validate(self) -> "EngineConfig":
        for name in ("max_num_seqs", "max_seq_len", "chunk_size", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)} must be >= 1")
        if self.chunk_size > self.max_batch_tokens:
            raise ValueError(
                f"chunk_size = {self.chunk_size} > max_batch_tokens = {self.max_batch_tokens}"
            )
        return self


class Engine:
    def __init__(
        self,
        model,
        config: EngineConfig = EngineConfig(),
        *,
        runner=None,
        decode_runner=None,
        eos_token_ids: tuple[int, ...] | None = None,
    ):
        """model: a K3Model run on its own device; or None with a `runner` (a pipeline).
        decode_runner: a separate decode group; requests are handed off to it when their
        prompt is done, and prefill and decode batches then run at the same time."""
        self.config = config.validate()
        self.runner = runner or LocalRunner(
            model, num_slots=config.max_num_seqs, max_seq_len=config.max_seq_len
        )
        self.decode_runner = decode_runner
        mcfg = self.runner.config
        self.vocab_size = mcfg.vocab_size
        self.eos_token_ids = tuple(eos_token_ids or (mcfg.eos_token_id,))
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._generators: dict[str, torch.Generator] = {}
        self._errors: list[GenerationResult] = []

    # ---- queue ----------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams | None = None
    ) -> None:
        """Queue a request. A request that can never run (empty prompt, ids outside the
        vocabulary, longer than max_seq_len, bad sampling values) finishes at the next step with
        finish_reason 'error' and the reason in `error`; it never stops other requests."""
        sampling = sampling or SamplingParams()
        req = Request(request_id, list(prompt_token_ids), sampling)
        reason = self._check(req)
        if reason:
            self._errors.append(
                GenerationResult(request_id, req.prompt_token_ids, [], "error", error=reason)
            )
            return
        self._generators[request_id] = make_generator(sampling)
        self.waiting.append(req)

    def _check(self, req: Request) -> str | None:
        try:
            req.sampling.validate()
        except ValueError as e:
            return str(e)
        ids = req.prompt_token_ids
        if not ids:
            return "empty prompt"
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})"
        if len(ids) >= self.config.max_seq_len:
            limit = self.config.max_seq_len
            return f"prompt of {len(ids)} tokens leaves no room in max_seq_len = {limit}"
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._errors)

    # ---- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[GenerationResult]:
        done, self._errors = self._errors, []
        while self.waiting and self._free_slots:
            req = self.waiting.popleft()
            req.slot_id, req.phase = self._free_slots.pop(), Phase.PREFILL
            self.running.append(req)
        prefill = [r for r in self.running if r.phase is Phase.PREFILL]
        decoding = [r for r in self.running if r.phase is Phase.DECODE]
        if self.decode_runner is None:  # one set of devices: prefill first, then decode
            if prefill:
                self._finish_prefills(self._submit_prefills(prefill))
            elif decoding:
                self._finish_decode(*self._submit_decode(decoding, self.runner))
        else:  # disaggregated: a prefill and a decode batch in flight at the same time
            prefills = self._submit_prefills(prefill)
            dec = self._submit_decode(decoding, self.decode_runner) if decoding else None
            self._finish_prefills(prefills)
            if dec:
                self._finish_decode(*dec)
        for req in [r for r in self.running if r.phase is Phase.FINISHED]:
            self.running.remove(req)
            self._free_slots.append(req.slot_id)
            self._generators.pop(req.request_id)
            done.append(self._result(req))
        return done

    def _submit_prefills(self, reqs: list[Request]) -> list:
        """Up to `runner.depth` prefill batches submitted back to back (a pipeline's stages
        all work). A batch's composition depends only on prompt progress, never on results,
        so one device and a pipeline run exactly the same batches."""
        submitted = []
        for _ in range(self.runner.depth):
            plan = self._plan_prefill(reqs)
            if not plan:
                break
            submitted.append(self._submit_prefill(plan))
        return submitted

    def _finish_prefills(self, submitted: list) -> None:
        for plan, batch, want_all, handle in submitted:
            self._finish_prefill(plan, batch, want_all, self.runner.wait(handle))

    def _plan_prefill(self, reqs: list[Request]) -> list[tuple[Request, int]]:
        plan, budget = [], self.config.max_batch_tokens
        for r in reqs:
            n = min(self.config.chunk_size, len(r.prompt_token_ids) - r.num_computed, budget)
            if n > 0:
                plan.append((r, n))
                budget -= n
        return plan

    def _submit_prefill(self, plan):
        ids = [t for r, n in plan for t in r.prompt_token_ids[r.num_computed : r.num_computed + n]]
        batch = ForwardBatch(
            seq_lens=[n for _, n in plan],
            cached_lens=[r.num_computed for r, _ in plan],
            slot_ids=[r.slot_id for r, _ in plan],
        )
        want_all = any(r.sampling.prompt_logprobs for r, _ in plan)
        handle = self.runner.submit(ids, batch, all_logits=want_all)
        for r, n in plan:
            r.num_computed += n
        return plan, batch, want_all, handle

    def _finish_prefill(self, plan, batch, want_all, logits) -> None:
        cu = batch.cu_seqlens
        for j, (r, n) in enumerate(plan):
            if want_all:
                rows = logits[cu[j] : cu[j + 1]]
                if r.sampling.prompt_logprobs:
                    self._add_prompt_logprobs(r, rows, batch.cached_lens[j], n)
                last = rows[-1]
            else:
                last = logits[j]
            if batch.cached_lens[j] + n == len(r.prompt_token_ids):
                r.phase = Phase.DECODE
                self._append_token(r, last)
                if self.decode_runner is not None and r.phase is Phase.DECODE:
                    # The prompt's caches move from the prefill side to the decode group;
                    # calls to each actor run in order, so the next decode step sees them.
                    layout = self.decode_runner.layout
                    pieces = self.runner.export_request(r.slot_id, r.num_computed, layout)
                    self.decode_runner.import_request(r.slot_id, pieces)

    def _add_prompt_logprobs(self, req: Request, rows_TV, start: int, n: int) -> None:
        """rows_TV: logits at prompt positions start .. start+n-1."""
        if start == 0:
            req.prompt_logprobs.append(None)
        targets = req.prompt_token_ids[start + 1 : start + n + 1]
        lp = torch.log_softmax(rows_TV[: len(targets)], dim=-1)
        req.prompt_logprobs.extend(lp.gather(-1, torch.tensor(targets)[:, None])[:, 0].tolist())

    def _submit_decode(self, reqs: list[Request], runner):
        """One decode batch. A runner with a `scratch_slot` (a decode group) gets the batch
        padded to a power of two (capped at max_num_seqs) with dummy rows in that slot, so
        decode steps take few distinct shapes, as CUDA-graph capture needs; their logits are
        dropped. Padding rows read and write only the scratch slot."""
        ids = [r.all_token_ids[-1] for r in reqs]
        cached = [r.num_computed for r in reqs]
        slots = [r.slot_id for r in reqs]
        scratch = getattr(runner, "scratch_slot", None)
        if scratch is not None:
            pad = min(self.config.max_num_seqs, 1 << (len(reqs) - 1).bit_length()) - len(reqs)
            ids, cached, slots = ids + [0] * pad, cached + [1] * pad, slots + [scratch] * pad
        batch = ForwardBatch(seq_lens=[1] * len(ids), cached_lens=cached, slot_ids=slots)
        return reqs, runner, runner.submit(ids, batch, all_logits=False)

    def _finish_decode(self, reqs: list[Request], runner, handle) -> None:
        logits = runner.wait(handle)
        for r, row in zip(reqs, logits):
            r.num_computed += 1
            self._append_token(r, row)

    def _append_token(self, req: Request, logits_V) -> None:
        p = req.sampling
        tok = sample(logits_V, p, self._generators[req.request_id])
        req.output_token_ids.append(tok)
        if p.logprobs:
            req.output_logprobs.append(float(torch.log_softmax(logits_V, -1)[tok]))
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
        if tok in stops:
            req.finish_reason = "stop"
        elif len(req.output_token_ids) >= p.max_new_tokens or (
            len(req.all_token_ids) >= self.config.max_seq_len
        ):
            req.finish_reason = "length"
        if req.finish_reason:
            req.phase = Phase.FINISHED

    def _result(self, req: Request) -> GenerationResult:
        p = req.sampling
        return GenerationResult(
            req.request_id,
            req.prompt_token_ids,
            req.output_token_ids,
            req.finish_reason,
            output_logprobs=req.output_logprobs if p.logprobs else None,
            prompt_logprobs=req.prompt_logprobs if p.prompt_logprobs else None,
        )

    # ---- convenience ----------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Run prompts to completion; results in the order of `prompts`."""
        if not isinstance(sampling, list):
            sampling = [sampling] * len(prompts)
        for i, (ids, sp) in enumerate(zip(prompts, sampling)):
            self.add_request(str(i), ids, sp)
        out: dict[str, GenerationResult] = {}
        while self.has_unfinished():
            for res in self.step():
                out[res.request_id] = res
        return [out[str(i)] for i in range(len(prompts))]
