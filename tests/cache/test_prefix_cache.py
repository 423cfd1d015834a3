"""Prefix caching and memory pressure through the engine (CPU, fp32 k3batch.testing.K3_MINI).

Exact (`==` on tokens and on every output log-probability): a prefix-cache hit against a miss,
with one request at a time (max_num_seqs = 1) so that every forward has the same batch
composition either way; a hit starts at a cut point of the request's own chunk plan, so the
hit computes the very same chunks as the miss (and its KDA checkpoint came out of the same
chunks too). Covered: many samples of one prompt, branches D and E after a shared prefix ABC,
hits after eviction pressure, the static pool, and retraction when pages run out (greedy
tokens equal each request run alone).
"""

import dataclasses

import pytest
import torch

from k3batch.engine.config import EngineConfig
from k3batch.engine.engine import Engine
from k3batch.engine.request import SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True, logprobs=True)
CFG = EngineConfig(max_num_seqs=1, max_seq_len=96, chunk_size=8, page_size=4)
ROOMY = 8  # an arena for ROOMY requests of max_seq_len: checkpoints of earlier prompts fit


def _tokens(n, seed):
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine, prompts, sampling=GREEDY):
    out = []
    for p in prompts:  # one after another: the cache sees the earlier ones
        (r,) = engine.generate([p], sampling)
        engine.pool.check_integrity()
        out.append((r.output_token_ids, r.output_logprobs))
    return out


def _misses(model, prompts, cfg):
    return [_run(Engine(model, cfg), [p])[0] for p in prompts]


def _sized(model, cfg, num_blocks, num_pages):
    """cfg with an arena of num_blocks KDA blocks plus num_pages pages."""
    spec = Engine(model, cfg).pool.arena.specs[0]
    nbytes = num_blocks * spec.block_bytes + num_pages * spec.page_bytes
    return dataclasses.replace(cfg, cache_bytes=nbytes)


def test_hits_are_bit_identical_to_misses(model_factory):
    model = model_factory("k3-mini")
    abc = _tokens(26, 1)
    prompts = [
        abc,
        abc,  # another sample of the same prompt: a hit at its last page boundary (24)
        abc + _tokens(7, 2),  # D after ABC
        abc + _tokens(9, 3),  # E after ABC
        _tokens(5, 4) + abc,  # no shared prefix
    ]
    cfg = _sized(model, CFG, ROOMY, ROOMY * 24)
    engine = Engine(model, cfg)
    got = _run(engine, prompts)
    assert got == _misses(model, prompts, cfg)
    stats = engine.cache_stats()["cache"]
    assert stats["prefix_hits"] == 3 and stats["checkpoints_saved"] >= 3
    assert stats["prefix_hit_tokens"] == 24 + 24 + 24  # D and E resume at ABC's cut 24


def test_hits_after_eviction_pressure(model_factory):
    model = model_factory("k3-mini")
    base = [_tokens(20, s) for s in (10, 11, 12)]
    # base 0's entries are evicted by the time its branch comes; base 2's are still there
    prompts = [base[0], base[1], base[2], base[2] + _tokens(5, 14), base[0] + _tokens(6, 13)]
    cfg = _sized(model, CFG, 3, 20)  # a request and two checkpoints: old ones are evicted
    engine = Engine(model, cfg)
    got = _run(engine, prompts)
    assert got == _misses(model, prompts, cfg)
    stats = engine.cache_stats()["cache"]
    assert stats["evicted_nodes"] > 0 and stats["prefix_hits"] >= 1


def test_no_prefix_cache_and_static_pool_give_the_same_tokens(model_factory):
    model = model_factory("k3-mini")
    prompts = [_tokens(17, 20), _tokens(17, 20) + _tokens(3, 21)]
    want = [t for t, _ in _run(Engine(model, CFG), prompts)]
    for change in ({"prefix_cache": False}, {"memory_pool": "static"}):
        engine = Engine(model, dataclasses.replace(CFG, **change))
        assert [t for t, _ in _run(engine, prompts)] == want, change
    assert Engine(model, dataclasses.replace(CFG, prefix_cache=False)).pool.tree is None


def test_pages_running_out_retract_the_youngest(model_factory):
    model = model_factory("k3-mini")
    prompts = [_tokens(n, 30 + n) for n in (9, 6, 11, 5)]
    sp = dataclasses.replace(GREEDY, max_new_tokens=14, logprobs=False)
    cfg = dataclasses.replace(CFG, max_num_seqs=4, prefix_cache=False)
    alone = [Engine(model, cfg).generate([p], sp)[0].output_token_ids for p in prompts]
    tight = _sized(model, cfg, 4, 15)  # four blocks; pages for two requests (7 pages each)
    engine = Engine(model, tight)
    results = engine.generate(prompts, sp)
    assert [r.output_token_ids for r in results] == alone
    assert engine.cache_stats()["cache"]["retracted"] > 0
    engine.pool.check_integrity()
    assert engine.pool.num_requests == 0


def test_a_request_that_can_never_fit_gets_an_error(model_factory):
    model = model_factory("k3-mini")
    engine = Engine(model, _sized(model, CFG, 1, 3))
    ok, big = engine.generate(
        [_tokens(5, 1), _tokens(30, 2)], dataclasses.replace(GREEDY, max_new_tokens=2)
    )
    assert ok.error is None and "does not fit" in big.error


@pytest.mark.parametrize("pool", ["unified", "static"])
def test_engine_config_rejects_bad_values(pool):
    EngineConfig(memory_pool=pool).validate()
    with pytest.raises(ValueError, match="memory_pool"):
        EngineConfig(memory_pool="split").validate()
    with pytest.raises(ValueError, match="page_size"):
        EngineConfig(page_size=0).validate()
