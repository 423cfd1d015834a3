"""Engine: requests in, tokens out, on one device or over Ray actor groups.

Contract: the engine knows nothing of text, and nothing of where the model runs (runners, see
`runner.py`). `add_request` queues token ids; each `step` admits what fits, prefills prompt
chunks and decodes one token for every request whose prompt is done: one after the other on a
single runner, at the same time when a separate decode runner (a TP/DCP group) takes requests
by handoff. It returns the requests that finished. On one device a step runs one prefill batch
or, with no prompt left, a decode step, launched before the host takes the tokens of the step
before it (`overlap`, see `_decode`). A pipeline (`runner.depth` stages) keeps `depth` prefill
batches in flight across steps, each step topping it up and taking the oldest (and any others
done), so its stages do not drain while chunks remain (`_fill_pipeline`; waiting for all of
them each step kept each stage busy P / (2P - 1) of the time); it decodes once every prefill
batch is taken, and runs the one-device engine's batches in the same order.

Disaggregated, the two sides run at their own pace: prefill batches stay in flight across
steps, a step waits for one only when it has no decode step to run (an 8,192-token chunk takes
about ten decode steps' time), and each side has its own `max_num_seqs` (`_num_admitted`). A
finished prompt moves to the decode group in two halves (`handoff.py`), so that decode steps
never queue behind the prefill batches that its export waits for.

Memory: each runner's arenas form one account (`cache.manager.CacheManager`; a separate one
for the decode group). A request is admitted when its KDA block and its prompt's pages fit;
a prefix hit starts it from a shared KDA checkpoint and shared pages. A decode step first
gives every request the page of its next token; when pages run out, the youngest request is
retracted: it frees its memory and later runs again from its prompt (same seed, same tokens),
so nothing is lost. Prompts are cut into chunks at fixed points (`chunks.py`).

Failures: what a request holds (its ids, its sampling values) can fail that request only, with
finish_reason 'error': it is checked when added, and an exception in its own work after a
forward (sampling, log-probabilities) aborts it alone. An exception in a forward itself is the
engine's and propagates.
"""

import contextlib
import logging
import time
from collections import deque

import torch

from k3batch.cache.manager import CacheManager
from k3batch.engine.chunks import chunk_cuts, plan_batch
from k3batch.engine.config import EngineConfig
from k3batch.engine.handoff import Handoff
from k3batch.engine.request import GenerationResult, Phase, Request, SamplingParams
from k3batch.engine.runner import SCRATCH, LocalRunner, memory_account, sized
from k3batch.engine.sampler import Sampled, add_prompt_logprobs, draw_seed, sample
from k3batch.model.forward_batch import ForwardBatch, to_device

log = logging.getLogger(__name__)

class Engine:
    def __init__(
        self,
        model,
        config: EngineConfig | None = None,
        *,
        runner=None,
        decode_runner=None,
        eos_token_ids: tuple[int, ...] | None = None,
        stop_check=None,
    ):
        """model: a K3Model run on its own device; or None with a `runner` (a pipeline).
        decode_runner: a separate decode group; requests are handed off to it when their
        prompt is done (`runner.export_request`; once `runner.exported`, then
        `decode_runner.import_request`: the prefill side must be a runner that can send, a
        pipeline of stage actors), and prefill and decode batches then run at the same time.
        stop_check(stop strings, output token ids) -> bool: whether the output's text holds one
        of the strings (the caller knows the tokenizer); needed for requests with `stop`."""
        config = (config or EngineConfig()).validate()
        self.runner = runner or LocalRunner(model, config)
        # A local runner sizes the automatic fields (0) from its arena; `actors.build` sizes
        # them for actor runners on GPUs; what is left takes the CPU values.
        sized_here = getattr(self.runner, "engine_config", None)
        self.config = config = sized_here or sized(config, cuda=False)
        self.decode_runner = decode_runner
        self.pool = memory_account(self.runner, config, config.prefix_cache)
        self.decode_pool = None
        if decode_runner is not None:
            if not hasattr(self.runner, "export_request"):
                raise ValueError(
                    "a decode group takes requests from prefill stage actors (a pipeline "
                    "runner), not from a model in this process"
                )
            self.decode_pool = memory_account(decode_runner, config, False)
        mcfg = self.runner.config
        self.vocab_size = mcfg.vocab_size
        self.eos_token_ids = tuple(eos_token_ids or (mcfg.eos_token_id,))
        self.stop_check = stop_check
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.last_step_prefill = False  # whether the last step ran prompt chunks
        self.last_step_tokens = 0  # tokens the last step submitted (prompt chunks or decode rows)
        self.last_step_submit_s = 0.0  # its time in runner.submit (one device: the host's enqueue)
        self._seeds: dict[str, int] = {}  # request -> its seed (drawn when none is given)
        # prompt prefixes that a running prefill will checkpoint -> that request (see _admit)
        self._pending: dict[tuple[int, ...], str] = {}
        self._errors: list[GenerationResult] = []
        self._prefilling: deque = deque()  # a pipeline's prefill batches in flight, oldest first
        self.handoff = Handoff(self)  # disaggregated: exports in flight, prefill batches sent
        # Overlapped decode (one runner that takes device tokens): the decode step whose tokens
        # are still on their way to the host, (requests, Sampled).
        self.overlap = (config.overlap and decode_runner is None
                        and getattr(self.runner, "feeds_tokens", False))  # fmt: skip
        self._inflight: tuple[list[Request], Sampled] | None = None

    # ---- queue ----------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams | None = None
    ) -> None:
        """Queue a request. Never raises for what a request holds: one that can never run (ids
        that are not integers of the vocabulary, empty, longer than max_seq_len, bad sampling
        values) finishes at the next step with finish_reason 'error' and the reason in `error`;
        it never stops other requests."""
        sampling = SamplingParams() if sampling is None else sampling
        ids = list(prompt_token_ids) if isinstance(prompt_token_ids, list | tuple) else None
        req = Request(request_id, ids or [], sampling)
        reason = (
            req.problem(self.vocab_size, self.config.max_seq_len, self.stop_check is not None)
            if ids is not None
            else "prompt token ids must be a list"
        )
        if reason:
            self._fail(req, reason)
            return
        req.cuts = chunk_cuts(len(req.prompt_token_ids), self.config.chunk_size,
                              self.config.page_size if self.pool.tree is not None else None,
                              sampling.prompt_logprobs_start)  # fmt: skip
        self._seeds[request_id] = draw_seed() if sampling.seed is None else sampling.seed
        self.waiting.append(req)

    def _fail(self, req: Request, reason: str) -> None:
        self._errors.append(
            GenerationResult(req.request_id, req.prompt_token_ids, [], "error", error=reason)
        )

    def has_unfinished(self) -> bool:
        """Requests to run or report, or prefill batches in flight (those of failed requests
        too: they are taken before the engine goes idle)."""
        return bool(self.waiting or self.running or self._errors or self._prefilling)

    def sizing(self) -> dict:
        """What was chosen up front: the sized limits, the arena bytes of each device of the
        (prefill) runner, and the measured prefill workspace (None where not measured)."""
        return {
            "max_num_seqs": self.config.max_num_seqs,
            "max_batch_tokens": self.config.max_batch_tokens,
            "arena_bytes": [spec.total_bytes for spec in self.runner.cache_specs()],
            "workspace_bytes": getattr(self.runner, "workspace_bytes", None),
        }

    def cache_stats(self) -> dict:
        """Memory and prefix-cache counters of each account."""
        out = {"prefill" if self.decode_pool else "cache": vars(self.pool.stats).copy()}
        if self.decode_pool is not None:
            out["decode"] = vars(self.decode_pool.stats).copy()
        return out

    # ---- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[GenerationResult]:
        self.last_step_tokens, self.last_step_submit_s = 0, 0.0
        self._admit()
        if self.decode_runner is None and self.runner.depth == 1:  # prefill first, then decode
            prefill = [r for r in self.running if r.phase is Phase.PREFILL]
            self.last_step_prefill = bool(prefill)
            if prefill:
                self._take_inflight()
                self._finish_prefills(self._submit_prefills(prefill, self.runner.depth))
            elif decoding := self._make_room(self.pool):
                self._decode(decoding, self.runner, self.pool)
            else:
                self._take_inflight()
        elif self.decode_runner is None:  # a pipeline that decodes too: see _fill_pipeline
            self._fill_pipeline()
            self.last_step_prefill = bool(self._prefilling)
            if self._prefilling:
                self._finish_prefills([self._prefilling.popleft()])
                while self._prefilling and self.runner.ready(self._prefilling[0][3]):
                    self._finish_prefills([self._prefilling.popleft()])
            elif decoding := self._make_room(self.pool):  # every prefill batch finished
                self._decode(decoding, self.runner, self.pool)
        else:  # disaggregated: prefill batches in flight across steps, a decode step each step
            prefill = [r for r in self.running if r.phase is Phase.PREFILL]
            self.last_step_prefill = bool(prefill or self._prefilling)
            free = self.runner.depth - len(self._prefilling)
            submitted = self._submit_prefills(prefill, free)
            self._prefilling.extend(submitted)
            self.handoff.num_prefills += len(submitted)
            if decoding := self._make_room(self.decode_pool):
                self._decode(decoding, self.decode_runner, self.decode_pool)
            elif self._prefilling or self.handoff.exports:  # nothing else to wait for
                self.handoff.wait()
            while self._prefilling and self.runner.ready(self._prefilling[0][3]):
                self._finish_prefills([self._prefilling.popleft()])
            self.handoff.move()
        done, self._errors = self._errors, []
        for req in [r for r in self.running if r.phase is Phase.FINISHED]:
            self._drop(req)
            self._seeds.pop(req.request_id)
            done.append(req.result())
        return done

    def _drop(self, req: Request) -> None:
        # Nothing fails or retracts a request whose export is in flight (its prefill is done,
        # it takes no decode step): its decode memory must stay until its import is queued.
        assert not self.handoff.exporting(req), req.request_id
        self.running.remove(req)
        for prefix in [k for k, rid in self._pending.items() if rid == req.request_id]:
            del self._pending[prefix]
        for pool in (self.pool, self.decode_pool):
            if pool is not None and pool.holds(req.request_id):
                pool.release(req.request_id)

    def _admit(self) -> None:
        """Admit waiting requests in order while they fit (KDA block + prompt pages). With
        the prefix cache, a request whose prefix a running prefill is about to checkpoint
        waits for that checkpoint (the choices of one context, admitted together, would all
        miss otherwise); admission stays in order."""
        ps = self.config.page_size
        while self.waiting and self._num_admitted() < self.config.max_num_seqs:
            req = self.waiting[0]
            ids = req.prompt_token_ids
            points = req.cuts
            if req.sampling.prompt_logprobs:  # the rows from score_start - 1 on must be computed
                points = [c for c in req.cuts if c < req.sampling.prompt_logprobs_start]
            if self._pending and any(tuple(ids[:p]) in self._pending for p in points):
                return  # its checkpoint is on the way
            hit = self.pool.admit(req.request_id, ids, len(ids), points)
            if hit is None:
                if any(self.pool.holds(r.request_id) for r in self.running):
                    return  # wait for room
                self.waiting.popleft()
                self._abort(req, f"prompt of {len(ids)} tokens does not fit in the cache pool")
                continue
            self.waiting.popleft()
            req.num_computed, req.phase = hit, Phase.PREFILL
            self.running.append(req)
            if self.pool.tree is not None:  # the checkpoints its prefill will save
                for p in req.cuts:
                    if p > hit and p % ps == 0:
                        self._pending.setdefault(tuple(ids[:p]), req.request_id)

    def _num_admitted(self) -> int:
        """Requests that count against admission: all running ones on one runner; with a
        decode group, those that hold prefill memory (decoding ones and those whose import is
        pending hold decode memory: they count against the handoff, `Handoff.num_decoding`)."""
        if self.decode_runner is None:
            return len(self.running)
        return sum(r.phase is not Phase.DECODE for r in self.running) - len(self.handoff.exports)

    def _make_room(self, pool: CacheManager) -> list[Request]:
        """The decoding requests of `pool`, each with a page for its next token; when pages
        run out the youngest is retracted (oldest requests keep going). A request whose token
        in flight (overlapped decode) is its last by length takes no further step. When the
        decode group's pages run out with imports pending, those are imported first (waiting
        for their exports), so retraction chooses among every request that holds decode
        memory, as if they had been imported at once."""
        pending = self._pending_rows()
        decoding = [
            r for r in self.running
            if r.phase is Phase.DECODE and pool.holds(r.request_id)
            and not (r in pending and r.last_by_length(self.config.max_seq_len))
        ]  # fmt: skip
        i = 0
        while i < len(decoding):  # decoding[i + 1:] may shrink from the end (retractions)
            req = decoding[i]
            while not pool.grow(req.request_id, req.num_computed + 1):
                if self.handoff.exports:  # the decode group's pool: see above
                    self.handoff.import_ready(flush=True)
                    return self._make_room(pool)
                victim = decoding.pop()
                if victim is req and not decoding:
                    n = req.num_computed + 1
                    self._abort(req, f"request of {n} tokens does not fit in the cache pool")
                    break
                self._retract(victim, pool)
                if victim is req:
                    break
            i += 1
        return decoding

    def _retract(self, req: Request, pool: CacheManager) -> None:
        self._drop(req)
        req.restart()  # same seed, so the same tokens again
        self.waiting.appendleft(req)
        pool.stats.retracted += 1

    def _abort(self, req: Request, reason: str) -> None:
        if req in self.running:
            self._drop(req)
        req.phase = Phase.FINISHED  # a token of it still in flight is dropped unread
        self._seeds.pop(req.request_id)
        self._fail(req, reason)

    # ---- prefill --------------------------------------------------------------------------
    def _submit_prefills(self, reqs: list[Request], max_batches: int) -> list:
        """Up to max_batches prefill batches submitted back to back (`runner.depth` keeps a
        pipeline's stages all busy). A batch's composition depends only on prompt progress,
        never on results, so one device and a pipeline run exactly the same batches."""
        submitted = []
        for _ in range(max_batches):
            plan = plan_batch(reqs, self.config.max_batch_tokens)
            if not plan:
                break
            submitted.append(self._submit_prefill(plan))
        return submitted

    def _fill_pipeline(self) -> None:
        """Top a pipeline that also decodes up to `runner.depth` prefill batches in flight
        (`_prefilling`, across steps). Requests are admitted before each batch, as the
        one-device engine admits before each of its one-batch steps, so both submit the same
        batches in the same order: a batch's composition depends on prompt progress and on the
        running set, which results change only where a request ends in its prefill (its first
        token is its last, or it fails): its room goes to the next request once its batch is
        taken, up to depth - 1 batches later here. No decode step runs while a prefill batch
        is in flight (`step`): it would read caches that they write, and no request retracted
        for its pages may have a batch in flight."""
        for i in range(self.runner.depth - len(self._prefilling)):
            if i:
                self._admit()
            plan = plan_batch([r for r in self.running if r.phase is Phase.PREFILL],
                              self.config.max_batch_tokens)
            if not plan:
                return
            self._prefilling.append(self._submit_prefill(plan))

    def _finish_prefills(self, submitted: list) -> None:
        for plan, batch, want_all, handle in submitted:
            self._finish_prefill(plan, batch, want_all, self.runner.wait(handle))

    def _submit_prefill(self, plan):
        ids = [t for r, n in plan for t in r.prompt_token_ids[r.num_computed : r.num_computed + n]]
        batch = ForwardBatch(
            seq_lens=[n for _, n in plan],
            cached_lens=[r.num_computed for r, _ in plan],
            slot_ids=[self.pool.block_of(r.request_id) for r, _ in plan],
            page_tables=[self.pool.pages_of(r.request_id) for r, _ in plan],
        )
        want_all = any(r.sampling.prompt_logprobs for r, _ in plan)
        self.runner.apply(self.pool.drain())
        handle = self._submit(self.runner, batch.num_tokens, ids, batch, want_all)
        ps = self.config.page_size
        for r, n in plan:
            r.num_computed += n
            end = r.num_computed
            if self.pool.tree is not None and end in r.cuts and end % ps == 0:
                self.pool.save_checkpoint(r.request_id, r.prompt_token_ids[:end])
                if self._pending.get(key := tuple(r.prompt_token_ids[:end])) == r.request_id:
                    del self._pending[key]
        return plan, batch, want_all, handle

    def _submit(self, runner, tokens: int, *args, **kwargs):
        """runner.submit(*args, **kwargs), counted in `last_step_tokens` (tokens) and
        `last_step_submit_s`."""
        t0 = time.perf_counter()
        handle = runner.submit(*args, **kwargs)
        self.last_step_submit_s += time.perf_counter() - t0
        self.last_step_tokens += tokens
        return handle

    def _finish_prefill(self, plan, batch, want_all, logits) -> None:
        cu = batch.cu_seqlens
        done, last = [], []
        for j, (r, n) in enumerate(plan):
            if r not in self.running:
                continue  # failed in an earlier batch (this one was in flight then)
            with self._failing_alone(r):
                if want_all and r.sampling.prompt_logprobs:
                    rows = logits[cu[j] : cu[j + 1]]
                    add_prompt_logprobs(r, rows, batch.cached_lens[j], n)
                if batch.cached_lens[j] + n == len(r.prompt_token_ids):
                    r.phase = Phase.DECODE if self.decode_runner is None else Phase.HANDOFF
                    done.append(r)
                    last.append(cu[j + 1] - 1 if want_all else j)
        if done:
            self._sample(done, logits[to_device(last, logits.device)])

    @contextlib.contextmanager
    def _failing_alone(self, req: Request):
        """Per-request work after a forward (sampling, log-probabilities): an exception there
        fails this request only, with the exception as its error."""
        try:
            yield
        except Exception as e:
            self._fail_alone(req, e)

    def _fail_alone(self, req: Request, e: Exception) -> None:
        log.exception("request %s failed; the others go on", req.request_id)
        self._abort(req, f"{type(e).__name__}: {e}")

    # ---- decode ---------------------------------------------------------------------------
    def _pending_rows(self) -> dict[Request, int]:
        """Requests whose token is in flight -> their row in that decode step."""
        return {r: i for i, r in enumerate(self._inflight[0])} if self._inflight else {}

    def _decode(self, reqs: list[Request], runner, pool: CacheManager) -> None:
        """One decode step. A runner that `pads_decode` (a decode group; one device with CUDA
        graphs) gets the batch padded to a power of two (capped at max_num_seqs) with dummy
        rows in the scratch block and page, so decode steps take the few shapes that CUDA
        graphs were captured for; their logits are dropped.
        Overlapped (`self.overlap`): a request whose last token is in flight feeds it from the
        device (`runner.submit(feed=...)`), and this step is sampled before the host takes the
        last one's tokens, so the device has a step queued while the host does bookkeeping. A
        request stopping on a token in flight has computed one more, dropped unread."""
        pending = self._pending_rows()
        rids = [r.request_id for r in reqs]
        cached = [r.num_computed for r in reqs]
        if getattr(runner, "pads_decode", False):
            pad = min(self.config.max_num_seqs, 1 << (len(reqs) - 1).bit_length()) - len(reqs)
            rids, cached = rids + [SCRATCH] * pad, cached + [1] * pad
        batch = ForwardBatch(
            seq_lens=[1] * len(rids),
            cached_lens=cached,
            slot_ids=[pool.block_of(rid) for rid in rids],
            page_tables=[pool.pages_of(rid) for rid in rids],
        )
        runner.apply(pool.drain())
        ids = [-1 - pending[r] if r in pending else r.last_token_id for r in reqs]
        feed = {"feed": self._inflight[1].tokens} if pending else {}
        handle = self._submit(runner, len(reqs), ids + [0] * (len(rids) - len(reqs)), batch,
                              False, **feed)  # fmt: skip
        logits = runner.wait(handle)[: len(reqs)]
        for r in reqs:
            r.num_computed += 1
        try:
            sampled = self._draw(reqs, logits, [len(r.output_token_ids) + (r in pending)
                                                for r in reqs])  # fmt: skip
        except Exception:
            log.exception("sampling a batch of %d failed; sampling each alone", len(reqs))
            sampled = None
        self._take_inflight()
        if sampled is None:
            live = [i for i, r in enumerate(reqs) if r.phase is Phase.DECODE]
            self._sample_each([reqs[i] for i in live], logits[live])
        elif self.overlap:
            self._inflight = reqs, sampled
        else:
            self._take(reqs, sampled)

    def _take_inflight(self) -> None:
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            self._take(*inflight)

    def _take(self, reqs: list[Request], sampled: Sampled) -> None:
        """Append sampled tokens to their requests, but not to those finished, failed or
        retracted since the step was launched."""
        tokens, logprobs = sampled.result()
        eos, max_len = self.eos_token_ids, self.config.max_seq_len
        for i, r in enumerate(reqs):  # the hot loop of a decode step: no context manager
            if r.phase is Phase.FINISHED or r.phase is Phase.WAITING:
                continue
            try:
                r.append_token(tokens[i], logprobs[i] if logprobs else None, eos_token_ids=eos,
                               stop_check=self.stop_check, max_seq_len=max_len)  # fmt: skip
            except Exception as e:
                self._fail_alone(r, e)

    def _sample(self, reqs: list[Request], logits_BV) -> None:
        """One token for each request from its row of logits, sampled where the logits are.
        If the batch call fails, each request is sampled alone, so a failure stays its own."""
        try:
            sampled = self._draw(reqs, logits_BV, [len(r.output_token_ids) for r in reqs])
        except Exception:
            log.exception("sampling a batch of %d failed; sampling each alone", len(reqs))
            self._sample_each(reqs, logits_BV)
            return
        self._take(reqs, sampled)

    def _sample_each(self, reqs: list[Request], logits_BV) -> None:
        for i, r in enumerate(reqs):
            with self._failing_alone(r):
                self._take([r], self._draw([r], logits_BV[i : i + 1], [len(r.output_token_ids)]))

    def _draw(self, reqs: list[Request], logits_BV, positions: list[int]) -> Sampled:
        return sample(
            logits_BV,
            [r.sampling for r in reqs],
            [self._seeds[r.request_id] for r in reqs],
            positions,
            want_logprobs=any(r.sampling.logprobs for r in reqs),
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
