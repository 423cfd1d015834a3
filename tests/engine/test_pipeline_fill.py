"""A pipeline that prefills and decodes (pp > 1, no decode group) keeps `depth` prefill batches
in flight across steps (`Engine._fill_pipeline`): each step tops it up and takes the oldest
batch, so its stages never drain while prompt chunks remain. In process: `LazyPipeline`, a
LocalRunner (k3-mini, fp32, CPU) whose calls queue up and run in order only when a forward is
waited on, as a pipeline's stages run them; it logs how many batches are in flight at each
submit and wait. The batches (seq_lens, cached_lens, KDA blocks, page tables, in order) and the
greedy tokens are the one-device engine's, under retraction and the prefix cache too; no decode
step is submitted while a prefill batch is in flight; a request that fails in its prefill with
batches still in flight fails alone. On Ray, a pp 2 PipelineRunner runs the same batches and
tokens as one device."""

import dataclasses

import pytest
import torch

import k3batch.engine.engine as engine_module
from k3batch.engine.config import EngineConfig
from k3batch.engine.engine import Engine
from k3batch.engine.request import SamplingParams
from k3batch.engine.runner import LocalRunner
from k3batch.testing import batch_key, random_prompts

GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
CFG = EngineConfig(max_num_seqs=6, max_seq_len=64, chunk_size=8, max_batch_tokens=16,
                   page_size=4, prefix_cache=False)  # fmt: skip


class OneDevice(LocalRunner):
    """The reference: LocalRunner (depth 1) logging its batches, without the overlapped decode
    (a pipeline has none; it changes which decode steps run)."""

    feeds_tokens = False

    def __init__(self, model, config):
        super().__init__(model, config)
        self.batches = []

    def submit(self, ids, batch, all_logits, feed=None):
        self.batches.append(batch_key(batch))
        return super().submit(ids, batch, all_logits, feed)


class LazyPipeline(LocalRunner):
    """LocalRunner as a pipeline of `depth` stages: moves and forwards queue up and run in
    order when a forward is waited on (a stage runs its calls in the order issued). `ready`
    answers `answer` (False: only the oldest batch is taken each step). Logs (what, phase,
    batches in flight) at every submit and wait; `decoding` is set by the test while the engine
    runs a decode step."""

    feeds_tokens = False  # as PipelineRunner: no overlapped decode

    def __init__(self, model, config, depth: int, answer: bool = False):
        super().__init__(model, config)
        self.depth, self.answer, self.decoding = depth, answer, False
        self.batches, self.log = [], []
        self._queue, self._done = [], {}  # calls not run yet; forward index -> logits
        self._submitted = self._waited = 0

    def apply(self, moves) -> None:
        if moves:
            self._queue.append(lambda: LocalRunner.apply(self, moves))

    def submit(self, ids, batch, all_logits, feed=None):
        assert feed is None
        i, phase = self._submitted, "decode" if self.decoding else "prefill"
        self._submitted += 1
        self.batches.append(batch_key(batch))
        self.log.append(("submit", phase, self._submitted - self._waited))
        self._queue.append(lambda: self._done.__setitem__(
            i, LocalRunner.submit(self, ids, batch, all_logits)))  # fmt: skip
        return i

    def wait(self, i):
        assert i == self._waited, "batches are taken in the order submitted"
        phase = "decode" if self.decoding else "prefill"
        self.log.append(("wait", phase, self._submitted - self._waited))
        while i not in self._done:
            self._queue.pop(0)()
        self._waited += 1
        return self._done.pop(i)

    def ready(self, i) -> bool:
        return self.answer


def _pipelined(model, config, depth, answer=False) -> tuple[Engine, LazyPipeline]:
    runner = LazyPipeline(model, config, depth, answer)
    engine = Engine(None, config, runner=runner)
    decode = engine._decode

    def flagged(*args):
        runner.decoding = True
        try:
            return decode(*args)
        finally:
            runner.decoding = False

    engine._decode = flagged
    return engine, runner


def _run(engine, prompts, sampling=GREEDY) -> dict:
    """Run to the end; while prompt chunks remain and `ready` says no, each step takes one
    batch; the pipeline never holds more than `depth`. Request id -> result."""
    _add(engine, prompts, sampling)
    pipe, out = engine.runner, {}
    while engine.has_unfinished():
        waited = pipe._waited
        out |= {r.request_id: r for r in engine.step()}
        assert len(engine._prefilling) < pipe.depth
        assert pipe.answer or pipe._waited - waited == 1 or not engine.running
    assert not engine._prefilling and pipe._submitted == pipe._waited
    return out


def _add(engine, prompts, sampling) -> None:
    sampling = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, sampling)):
        engine.add_request(str(i), p, sp)


def _one_device(model, config, prompts, sampling=GREEDY) -> tuple[dict, OneDevice, Engine]:
    one = OneDevice(model, config)
    engine = Engine(None, config, runner=one)
    _add(engine, prompts, sampling)
    out = {}
    while engine.has_unfinished():
        out |= {r.request_id: r for r in engine.step()}
    return out, one, engine


def _tokens(out: dict) -> list:
    return [(out[k].output_token_ids, out[k].finish_reason) for k in sorted(out, key=int)]


@pytest.mark.parametrize("depth", [2, 3, 4])
def test_pipeline_stays_full_across_steps(model_factory, depth):
    """Six prompts (1 to 6 chunks, up to two chunks a batch), all admitted at once: every
    prefill batch but the last depth - 1 is taken with `depth` in flight, one a step; then the
    pipeline empties and decode steps run alone. Batches and tokens: one device's."""
    model = model_factory("k3-mini")
    prompts = random_prompts([37, 5, 44, 23, 30, 12])
    engine, pipe = _pipelined(model, CFG, depth)
    out = _run(engine, prompts)
    waits = [n for what, phase, n in pipe.log if what == "wait" and phase == "prefill"]
    tail = list(range(depth - 1, 0, -1))
    assert waits == [depth] * (len(waits) - len(tail)) + tail and len(waits) > 2 * depth
    first_decode = next(i for i, e in enumerate(pipe.log) if e[1] == "decode")
    assert all(e[1] == "decode" for e in pipe.log[first_decode:])
    assert all(n == 1 for _, phase, n in pipe.log if phase == "decode")  # nothing beside it
    want, one, _ = _one_device(model, CFG, prompts)
    assert pipe.batches == one.batches
    assert _tokens(out) == _tokens(want)


@pytest.mark.parametrize("answer", [False, True], ids=["oldest-only", "all-ready"])
@pytest.mark.parametrize("prefix_cache", [False, True], ids=["retraction", "prefix-cache"])
def test_batches_and_tokens_are_one_devices(model_factory, prefix_cache, answer):
    """An arena of 2.6 requests of max_seq_len (requests wait for room; decode steps retract,
    so prefill and decode alternate) or shared prefixes (requests wait for a checkpoint on the
    way, then hit it): whatever `ready` says, the pipeline submits the one-device engine's
    batches in its order (admission runs before every batch, as a one-device step does), no
    decode step beside a prefill batch, and the tokens are the same."""
    model = model_factory("k3-mini")
    request_bytes = LocalRunner(model, CFG).cache.layout.request_bytes(CFG.max_seq_len)
    config = dataclasses.replace(CFG, max_num_seqs=4, prefix_cache=prefix_cache,
                                 cache_bytes=int(2.6 * request_bytes))  # fmt: skip
    if prefix_cache:
        prompts = random_prompts([9, 21, 3, 9, 14], seed=1, prefix=range(100, 123))
    else:
        prompts = random_prompts([37, 5, 44, 23, 30, 12, 41])
    want, one, ref = _one_device(model, config, prompts)
    engine, pipe = _pipelined(model, config, 3, answer)
    out = _run(engine, prompts)
    assert pipe.batches == one.batches
    assert _tokens(out) == _tokens(want)
    assert all(n == 1 for _, phase, n in pipe.log if phase == "decode")
    skip = {"admission_waits": 0}  # the pipeline's steps that only take a batch admit too
    assert vars(engine.pool.stats) | skip == vars(ref.pool.stats) | skip
    stats = ref.pool.stats
    assert stats.retracted > 0 if not prefix_cache else stats.prefix_hits >= 3
    if not answer:  # the pipeline filled between decode phases
        assert max(n for what, _, n in pipe.log if what == "wait") == 3


def test_a_request_failing_in_its_prefill_fails_alone(model_factory, monkeypatch):
    """A request whose prompt log-probabilities fail on its first chunk is aborted while its
    later chunks are in flight: those batches are taken (its rows skipped), its memory is
    reused only by calls queued after them, and the others' tokens are one device's."""
    model = model_factory("k3-mini")
    real = engine_module.add_prompt_logprobs

    def failing(req, *args):
        if req.request_id == "1":
            raise RuntimeError("poisoned row")
        return real(req, *args)

    monkeypatch.setattr(engine_module, "add_prompt_logprobs", failing)
    prompts = random_prompts([20, 44, 23, 30, 12, 37])
    sampling = [GREEDY] * len(prompts)
    sampling[1] = dataclasses.replace(GREEDY, prompt_logprobs=True)
    config = dataclasses.replace(CFG, max_num_seqs=3)
    engine, pipe = _pipelined(model, config, 3)
    out = _run(engine, prompts, sampling)
    assert out["1"].finish_reason == "error" and "poisoned row" in out["1"].error
    want, one, _ = _one_device(model, config, prompts, sampling)
    assert _tokens(out) == _tokens(want)
    # Its next two chunks were in flight when it failed (in batches 2 and 3, its block 1 at 8
    # and 16 cached tokens); one device gives its block to request 3 at once.
    assert [dict(zip(b[2], b[1]))[1] for b in pipe.batches[1:3]] == [8, 16]
    assert dict(zip(one.batches[1][2], one.batches[1][1]))[1] == 0


def test_ray_pipeline_runs_one_devices_batches(local_ray, mini_model_dir):
    """PipelineRunner over 2 stage actors (gloo, CPU), no decode group: the one-device engine's
    batches, in its order, and its greedy tokens (pipeline parallelism is bit-exact)."""
    from k3batch.actors.world import spawn_runners
    from k3batch.model.loader import load_model

    prompts = random_prompts([37, 5, 44, 23, 30, 12], seed=3)
    want, one, _ = _one_device(load_model(mini_model_dir, dtype=torch.float32), CFG, prompts)
    runner, _ = spawn_runners(mini_model_dir, num_stages=2, engine_config=CFG, device="cpu",
                              dtype=torch.float32)  # fmt: skip
    batches, submit = [], runner.submit
    runner.submit = lambda ids, batch, all_logits: (
        batches.append(batch_key(batch)) or submit(ids, batch, all_logits))  # fmt: skip
    try:
        engine = Engine(None, CFG, runner=runner)
        _add(engine, prompts, GREEDY)
        out = {}
        while engine.has_unfinished():
            out |= {r.request_id: r for r in engine.step()}
    finally:
        runner.shutdown()
    assert batches == one.batches
    assert _tokens(out) == _tokens(want)
