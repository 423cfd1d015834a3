"""Overlapped decode (`Engine._decode`): each step is launched before the host takes the tokens
of the step before it, whose tokens it reads on the device. It must change nothing that a
request sees: the same tokens and log-probs as `overlap = false`, with requests stopping on EOS,
stop tokens and stop strings a step after the next one was launched, finishing by length,
retracted when pages run out, on the plain and the static (graph) decode path.
"""

import dataclasses

import pytest
import torch

from k3batch.engine.config import EngineConfig
from k3batch.engine.engine import Engine
from k3batch.engine.request import SamplingParams
from k3batch.engine.runner import LocalRunner


def _prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (4 + 5 * i % 13,), generator=g).tolist() for i in range(n)]


class _Spy(LocalRunner):
    """Counts the decode steps whose inputs came from the device."""

    fed = 0

    def submit(self, ids, batch, all_logits, feed=None):
        self.fed += feed is not None
        return super().submit(ids, batch, all_logits, feed)


def _run(model, cfg, prompts, params, *, static: bool, **engine_kw):
    runner = _Spy(model, cfg, static_decode=static)
    eng = Engine(model, cfg, runner=runner, **engine_kw)
    out = eng.generate(prompts, params)
    assert eng.pool.num_requests == static  # only the scratch rows' request, when padding
    return [(r.output_token_ids, r.output_logprobs, r.finish_reason) for r in out], runner.fed, eng


@pytest.mark.parametrize("static", [False, True])
def test_overlapped_decode_gives_the_tokens_of_plain_decode(model_factory, static):
    model = model_factory("k3-mini")
    vocab = model.config.vocab_size
    prompts = _prompts(7, vocab)
    cfg = EngineConfig(max_num_seqs=8, max_seq_len=40, chunk_size=16, page_size=4)
    free = [SamplingParams(temperature=0.0 if i % 2 else 1.3, seed=i, max_new_tokens=6 + 3 * i,
                           ignore_eos=True, logprobs=True) for i in range(7)]  # fmt: skip
    want, fed, _ = _run(model, dataclasses.replace(cfg, overlap=False), prompts, free,
                        static=static)  # fmt: skip
    assert fed == 0
    # Stops taken from the free run: an EOS for request 1, a stop token for 2, a stop string
    # for 3 (each letter a token id), so that each stops while the next step is in flight.
    eos = want[1][0][3]
    spell = lambda ids: "".join(chr(97 + t % 26) for t in ids)  # noqa: E731
    params = list(free)
    params[1] = dataclasses.replace(free[1], ignore_eos=False)
    params[2] = dataclasses.replace(free[2], stop_token_ids=(want[2][0][4],))
    params[3] = dataclasses.replace(free[3], stop=(spell(want[3][0][2:5]),))
    kw = dict(eos_token_ids=(eos,), stop_check=lambda s, ids: any(x in spell(ids) for x in s))
    plain, fed, _ = _run(model, dataclasses.replace(cfg, overlap=False), prompts, params,
                         static=static, **kw)  # fmt: skip
    assert fed == 0
    over, fed, _ = _run(model, cfg, prompts, params, static=static, **kw)
    assert fed > 10, "the decode steps did not overlap"
    assert [r[2] for r in plain[1:4]] == ["stop"] * 3
    # Tokens exact; log-probs to fp32 rounding (a stopped request's extra row changes the
    # batch's shape, and with it the order of the CPU GEMMs' sums).
    assert [(t, why) for t, _, why in over] == [(t, why) for t, _, why in plain]
    for (tokens, lp, _), (_, lp_plain, _), (free_tokens, _, _) in zip(over, plain, want):
        assert tokens == free_tokens[: len(tokens)]
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(lp_plain), rtol=0, atol=1e-5)


def test_overlapped_decode_under_retraction(model_factory):
    """Pages run out while steps are in flight: the youngest request is retracted with a token
    of it in flight, runs again from its prompt and gets the tokens it gets alone."""
    model = model_factory("k3-mini")
    prompts = _prompts(4, model.config.vocab_size)
    sp = SamplingParams(temperature=1.0, seed=5, max_new_tokens=14, ignore_eos=True)
    cfg = EngineConfig(max_num_seqs=4, max_seq_len=32, chunk_size=16, page_size=4,
                       prefix_cache=False)  # fmt: skip
    alone = [Engine(model, cfg).generate([p], sp)[0].output_token_ids for p in prompts]
    layout_bytes = LocalRunner(model, cfg).cache.layout.request_bytes
    tight = dataclasses.replace(cfg, cache_bytes=2 * layout_bytes(18) + layout_bytes(1))
    eng = Engine(model, tight)
    assert eng.overlap
    assert [r.output_token_ids for r in eng.generate(prompts, sp)] == alone
    assert eng.cache_stats()["cache"]["retracted"] > 0
    eng.pool.check_integrity()
    assert eng.pool.num_requests == 0
