"""Scoring a continuation after its context from the engine's prompt log-probabilities
(`SamplingParams.prompt_logprobs_start`): no extra forward, and the choices of an item share
their context through the prefix cache.

Checked on the 9-layer k3-mini in fp32 (CPU): the log-likelihood of each choice (the sum of its
tokens' log-probs) equals the sum of log-softmax values of a full forward of the model over
context + continuation, with the prefix cache on and off; each greedy flag equals the full
forward's argmax test. Tolerance: one sequence in one unchunked forward matches to 9e-7; packing
four sequences into one forward, or cutting a prompt into chunks, changes fp32 summation orders,
which k3-debug's 93 random layers amplified to at most 2.6e-4 absolute (2e-4 per token, 1.7e-5
relative) on log-likelihoods of 15-35 nats, so the bound is 1e-3 absolute and 5e-5 relative (a
wrong row or an off-by-one position moves a log-likelihood by nats); with the cache on, a choice
restored from its context's checkpoint scores exactly what the first choice (a miss) scores; and
the cache saves the prefill of the shared contexts.
"""

import torch

from k3batch.engine.config import EngineConfig
from k3batch.engine.engine import Engine
from k3batch.engine.request import SamplingParams

PAGE = 16


def _items(vocab: int, n: int = 3, seed: int = 0):
    """[(context ids, [4 continuations])] with contexts of 40-70 tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        c = int(torch.randint(40, 71, (1,), generator=g))
        ctx = torch.randint(0, vocab, (c,), generator=g).tolist()
        conts = [torch.randint(0, vocab, (int(k),), generator=g).tolist()
                 for k in torch.randint(1, 6, (4,), generator=g)]  # fmt: skip
        out.append((ctx, conts))
    return out


def _score(model, items, *, prefix_cache: bool, max_num_seqs: int = 4):
    # 16 MiB: room for the checkpoints of ~20 k3-debug requests of 96 tokens, at any max_num_seqs
    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_seq_len=96, chunk_size=32,
                       max_batch_tokens=128, page_size=PAGE, prefix_cache=prefix_cache,
                       cache_bytes=16 << 20)  # fmt: skip
    eng = Engine(model, cfg)
    prompts, params = [], []
    for ctx, conts in items:
        for cont in conts:
            prompts.append(ctx + cont)
            params.append(SamplingParams(temperature=0.0, max_new_tokens=1, prompt_logprobs=True,
                                         prompt_logprobs_start=len(ctx)))  # fmt: skip
    return eng.generate(prompts, params), eng.cache_stats()["cache"]


def _reference(model, ctx, cont):
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids)[0].double(), dim=-1)
    rows = lp[len(ctx) - 1 : -1]  # row p scores token p + 1
    tgt = torch.tensor(cont)
    return rows.gather(-1, tgt[:, None])[:, 0], rows.argmax(-1) == tgt


def test_continuation_loglik_matches_full_forward(model_factory):
    model = model_factory("k3-mini")
    items = _items(model.config.vocab_size)
    flat = [(ctx, cont) for ctx, conts in items for cont in conts]
    refs = [_reference(model, ctx, cont) for ctx, cont in flat]  # one full forward each
    for prefix_cache in (True, False):
        results, _ = _score(model, items, prefix_cache=prefix_cache)
        for res, (ctx, cont), (ref_lp, ref_greedy) in zip(results, flat, refs):
            assert len(res.prompt_logprobs) == len(cont) == len(res.prompt_greedy)
            got, want = sum(res.prompt_logprobs), float(ref_lp.sum())
            assert abs(got - want) < min(1e-3, 5e-5 * abs(want)), (prefix_cache, got, want)
            assert res.prompt_greedy == ref_greedy.tolist()


def test_choices_share_their_context_exactly(model_factory):
    """Cache on: each later choice starts from the checkpoint the first one saved at the last
    page boundary of the context, and scores exactly what a miss does (same chunk cuts). One
    request per forward: packed, a sequence's bits depend on its place in the batch on CPU
    (reductions across tokens vectorize all but a tail, e.g. AttnRes' softmax over its
    candidates), so four identical choices packed together need not agree to the last bit."""
    model = model_factory("k3-mini")
    items = _items(model.config.vocab_size, n=2, seed=1)
    ctx, conts = items[0]
    same = [(ctx, [conts[0]] * 4)]  # four identical choices: misses and hits must agree
    results, stats = _score(model, same, prefix_cache=True, max_num_seqs=1)
    assert stats["prefix_hits"] == 3
    assert stats["prefix_hit_tokens"] == 3 * ((len(ctx) - 1) // PAGE * PAGE)
    first = results[0].prompt_logprobs
    assert all(r.prompt_logprobs == first for r in results[1:])
    assert all(r.prompt_greedy == results[0].prompt_greedy for r in results[1:])


def test_prefix_cache_saves_the_shared_contexts(model_factory):
    model = model_factory("k3-mini")  # a count
    items = _items(model.config.vocab_size, n=4, seed=2)
    _, stats = _score(model, items, prefix_cache=True)
    total = sum(len(ctx) + len(c) for ctx, conts in items for c in conts)
    want = sum(3 * ((len(ctx) - 1) // PAGE * PAGE) for ctx, _ in items)
    assert stats["prefix_hit_tokens"] == want
    assert want / total > 0.5  # 3 of 4 choices skip all but < 16 tokens of a 40-70 context
