"""The disaggregated engine's handoff in two halves (`engine/handoff.py`), on one process: a
prefill runner and a decode runner that are LocalRunners with caches of their own (k3-mini,
fp32, CPU), the export a copy of the request's cache and the import a write of it, and an
export that reports itself unfinished (`exported`) for `hold` checks, as a stage with prefill
batches queued ahead of it does. Decode steps go on meanwhile, the engine blocks on an export
only when it has nothing else to do, the admission bounds count the requests whose import is
pending, and the greedy tokens are the single-device engine's (the schedule changed, not the
math)."""

import dataclasses

import pytest
import torch

from k3batch.engine.config import EngineConfig
from k3batch.engine.engine import Engine
from k3batch.engine.request import Phase, SamplingParams
from k3batch.engine.runner import LocalRunner

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
CFG = EngineConfig(max_num_seqs=3, max_seq_len=64, chunk_size=8, page_size=4, prefix_cache=False)


class _Sent:
    def __init__(self, tensors, hold: int):
        self.tensors, self.hold, self.waited = tensors, hold, False


class PrefillSide(LocalRunner):
    """Exports a copy of the request's cache (the real stages copy into send buffers before
    any later forward); `exported` says no `hold` times per export."""

    def __init__(self, model, config, hold: int):
        super().__init__(model, config)
        self.hold, self.asked, self.waits = hold, 0, 0

    def ready(self, handle) -> bool:
        return True

    def export_request(self, block: int, pages: list[int], num_tokens: int) -> _Sent:
        tensors = self.cache.request_tensors(block, pages, num_tokens)
        copied = {kind: {i: t.clone() for i, t in layers.items()}
                  for kind, layers in tensors.items()}  # fmt: skip
        return _Sent(copied, self.hold)

    def exported(self, sent: _Sent) -> bool:
        self.asked += 1
        if sent.waited or sent.hold == 0:
            return True
        sent.hold -= 1
        return False

    def wait_exported(self, sent: _Sent) -> None:
        self.waits += 1
        sent.waited = True


class DecodeSide(LocalRunner):
    """Imports the copy into its own cache; logs every decode step with the requests whose
    import was pending then."""

    def __init__(self, model, config):
        super().__init__(model, config)
        self.engine, self.steps, self.imports = None, [], 0

    def import_request(self, block: int, pages: list[int], sent: _Sent) -> None:
        assert sent.waited or sent.hold == 0, "imported before every stage exported"
        self.cache.write_request_(block, pages, sent.tensors)
        self.imports += 1

    def submit(self, ids, batch, all_logits, feed=None):
        self.steps.append(len(self.engine.handoff.exports))
        return super().submit(ids, batch, all_logits, feed)


def _prompts(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in lens]


def _pair(model, hold: int, decode_cfg=CFG) -> Engine:
    prefill, decode = PrefillSide(model, CFG, hold), DecodeSide(model, decode_cfg)
    engine = Engine(None, CFG, runner=prefill, decode_runner=decode)
    decode.engine = engine
    return engine


def _run(engine, prompts, sampling=GREEDY) -> dict:
    """Run to the end, checking the bounds after every step: at most max_num_seqs requests
    hold prefill memory, at most max_num_seqs decode memory (decoding or import pending)."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sampling)
    out, pending = {}, set()
    while engine.has_unfinished():
        out |= {r.request_id: r.output_token_ids for r in engine.step()}
        exporting = {e.req for e in engine.handoff.exports}
        assert all(r.phase is Phase.HANDOFF for r in exporting)
        assert not any(engine.pool.holds(r.request_id) for r in exporting)
        prefill_side = [r for r in engine.running if engine.pool.holds(r.request_id)]
        decode_side = [r for r in engine.running if engine.decode_pool.holds(r.request_id)]
        assert engine._num_admitted() == len(prefill_side) <= CFG.max_num_seqs
        assert engine.handoff.num_decoding() == len(decode_side) <= CFG.max_num_seqs
        pending |= {r.request_id for r in exporting}
    return out, pending


@pytest.fixture(scope="module")
def reference(model_factory):
    model = model_factory("k3-mini")
    cache = {}

    def get(prompts, sampling=GREEDY):
        key = tuple(map(tuple, prompts)), sampling
        if key not in cache:
            cache[key] = [r.output_token_ids
                          for r in Engine(model, CFG).generate(prompts, sampling)]  # fmt: skip
        return cache[key]

    return get


@pytest.mark.parametrize("hold", [0, 1, 4])
def test_decode_steps_go_on_while_an_export_waits(model_factory, reference, hold):
    """Five prompts through max_num_seqs 3: with exports held, decode steps run while others'
    imports are pending, every request goes through the pending state, and the tokens are
    those of one device (hold 0: each export is ready at its first check, imported in the
    step that exported it, as before the handoff was split)."""
    prompts = _prompts([11, 4, 23, 17, 9])
    engine = _pair(model_factory("k3-mini"), hold)
    out, pending = _run(engine, prompts)
    assert [out[str(i)] for i in range(len(prompts))] == reference(prompts)
    decode = engine.decode_runner
    assert decode.imports == len(prompts)
    if hold:
        assert len(pending) == len(prompts)
        assert sum(n > 0 for n in decode.steps) >= hold  # decode steps beside pending imports
        assert engine.runner.asked >= len(prompts) * hold
    else:
        assert not pending and not engine.runner.waits


def test_nothing_else_to_do_blocks_on_the_oldest_export(model_factory, reference):
    """An export that never says yes by itself: with no decode step and no prefill batch in
    flight, the engine waits for it (`wait_exported`) instead of spinning."""
    prompts = _prompts([6])
    engine = _pair(model_factory("k3-mini"), hold=10**9)
    out, pending = _run(engine, prompts)
    assert out["0"] == reference(prompts)[0]
    assert engine.runner.waits == 1 and pending == {"0"}


def test_decode_pool_full_with_imports_pending(model_factory, reference):
    """A decode arena of 2.2 requests of max_seq_len: decode steps run out of pages
    while exports are held; the pending imports are taken in first (`Handoff.import_ready(flush)`),
    retraction picks among every request holding decode memory, and the tokens stay those of
    one device."""
    model = model_factory("k3-mini")
    request_bytes = LocalRunner(model, CFG).cache.layout.request_bytes(CFG.max_seq_len)
    small = dataclasses.replace(CFG, cache_bytes=int(2.2 * request_bytes))
    prompts = _prompts([30, 28, 26, 24, 22], seed=3)
    longer = dataclasses.replace(GREEDY, max_new_tokens=30)
    engine = _pair(model, hold=3, decode_cfg=small)
    flushes, imports = [], engine.handoff.import_ready
    engine.handoff.import_ready = lambda flush=False: flushes.append(flush) or imports(flush)
    out, _ = _run(engine, prompts, longer)
    assert [out[str(i)] for i in range(len(prompts))] == reference(prompts, longer)
    assert engine.decode_pool.stats.retracted > 0 and True in flushes
