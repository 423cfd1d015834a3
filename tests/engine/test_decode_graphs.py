"""The decode step on static buffers (`engine/graphs.py`): padded to buckets, staged in one copy.

CPU: the static path run eagerly gives the tokens of the plain engine (greedy, sampled with
seeds, logprobs), while batches shrink through every bucket as requests finish. GPU: every
bucket's graph replay gives the tokens of the same static step run eagerly, over 32 steps, and
log-probabilities within bf16 rounding.
"""

import pytest
import torch

from k3batch.engine.config import EngineConfig
from k3batch.engine.engine import Engine
from k3batch.engine.graphs import buckets_up_to
from k3batch.engine.request import SamplingParams
from k3batch.engine.runner import LocalRunner


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (5 + 3 * i,), generator=g).tolist() for i in range(n)]


def _run(model, cfg, prompts, params, **runner_kw):
    runner = LocalRunner(model, cfg, **runner_kw) if runner_kw else None
    eng = Engine(model, cfg, runner=runner)
    out = eng.generate(prompts, params)
    return [r.output_token_ids for r in out], [r.output_logprobs for r in out]


def test_buckets():
    assert buckets_up_to(1) == [1]
    assert buckets_up_to(8) == [1, 2, 4, 8]
    assert buckets_up_to(6) == [1, 2, 4, 6]


def test_static_decode_matches_plain_engine(model_factory):
    model = model_factory("k3-mini")  # a path check: depth adds nothing
    cfg = EngineConfig(max_num_seqs=6, max_seq_len=64, chunk_size=16, page_size=4)
    prompts = _prompts(5, model.config.vocab_size)
    # Lengths 3..11: the batch shrinks from 5 (bucket 6) through 4, 3 (4), 2, 1.
    params = [
        SamplingParams(max_new_tokens=3 + 2 * i, ignore_eos=True, logprobs=True,
                       temperature=0.0 if i % 2 else 1.5, seed=i)  # fmt: skip
        for i in range(5)
    ]
    plain_tokens, plain_lp = _run(model, cfg, prompts, params)
    static_tokens, static_lp = _run(model, cfg, prompts, params, static_decode=True)
    assert static_tokens == plain_tokens
    for a, b in zip(plain_lp, static_lp):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=0, atol=1e-4)


def test_static_decode_refuses_a_batch_past_its_buffers(model_factory):
    from k3batch.model.forward_batch import ForwardBatch

    model = model_factory("k3-debug")
    cfg = EngineConfig(max_num_seqs=2, max_seq_len=16, chunk_size=8, page_size=4)
    runner = LocalRunner(model, cfg, static_decode=True)
    batch = ForwardBatch(seq_lens=[1] * 3, cached_lens=[1] * 3, slot_ids=[0, 1, 2],
                         page_tables=[[0]] * 3)  # fmt: skip
    with pytest.raises(ValueError, match="exceeds the static buffers"):
        runner.submit([1, 2, 3], batch, all_logits=False)
    batch = ForwardBatch(seq_lens=[1], cached_lens=[4], slot_ids=[0], page_tables=[[0]])
    with pytest.raises(ValueError, match="no page for its token at position 4"):
        runner.submit([1], batch, all_logits=False)


@pytest.mark.gpu
def test_graph_replay_equals_eager_every_bucket():
    from k3batch.model import K3Model, get_flavor
    from k3batch.model.init import init_random_

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = K3Model(get_flavor("k3-debug"), dtype=torch.bfloat16, device="cuda")
    init_random_(model, seed=0).eval().set_backend("fla")
    kw = dict(max_num_seqs=8, max_seq_len=128, chunk_size=64, page_size=16,
              cache_bytes=2**28)  # two runners share the GPU: no default fraction each
    graphed = LocalRunner(model, EngineConfig(**kw))
    assert sorted(graphed.graphs.graphs) == buckets_up_to(8)
    eager_cfg = EngineConfig(**kw, cuda_graphs=False)
    for b in buckets_up_to(8):
        prompts = _prompts(b, model.config.vocab_size, seed=b)
        params = [SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True,
                                 logprobs=True)] * b  # fmt: skip
        out = Engine(model, EngineConfig(**kw), runner=graphed).generate(prompts, params)
        eager_tokens, eager_lp = _run(model, eager_cfg, prompts, params, static_decode=True)
        assert [r.output_token_ids for r in out] == eager_tokens, f"bucket {b}"
        for r, lp in zip(out, eager_lp):
            torch.testing.assert_close(
                torch.tensor(r.output_logprobs), torch.tensor(lp), rtol=0, atol=2e-2
            )
