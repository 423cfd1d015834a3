"""A request's seed decides its samples: different seeds give different samples, the same seed
gives the same, and unseeded requests differ from each other.

These fail on a sampler that ignores the seed (in `make_generator`, `gen.manual_seed(0)` for
every request) or seeds unseeded requests with a constant; the older test (same seed, same
tokens across batches) passes on both.
"""

import torch

from k3batch.engine.config import EngineConfig
from k3batch.engine.engine import Engine
from k3batch.engine.request import SamplingParams
from k3batch.engine.sampler import make_generator, sample

V, STEPS = 1000, 8


def _draws(seed, logits=None) -> list[int]:
    """STEPS tokens from near-uniform logits over V: two independent generators agree on all
    of them with probability about V**-STEPS."""
    params = SamplingParams(temperature=1.0, seed=seed)
    gen = make_generator(params)
    if logits is None:
        logits = torch.randn(V, generator=torch.Generator().manual_seed(0)) * 0.1
    return [sample(logits, params, gen) for _ in range(STEPS)]


def test_sampler_same_seed_same_samples():
    assert _draws(7) == _draws(7)


def test_sampler_different_seeds_different_samples():
    draws = [tuple(_draws(s)) for s in range(5)]
    assert len(set(draws)) == 5


def test_sampler_unseeded_requests_differ():
    assert _draws(None) != _draws(None)


def test_engine_request_seeds_decide_samples(model_factory):
    """The same through the engine, so a seed that never reaches the sampler fails too."""
    model = model_factory("k3-debug")
    prompt = torch.randint(0, 256, (6,), generator=torch.Generator().manual_seed(3)).tolist()

    def run(*seeds):
        eng = Engine(model, EngineConfig(max_num_seqs=4, max_seq_len=64, chunk_size=16))
        ps = [
            SamplingParams(temperature=20.0, seed=s, max_new_tokens=STEPS, ignore_eos=True)
            for s in seeds
        ]
        return [tuple(r.output_token_ids) for r in eng.generate([prompt] * len(seeds), ps)]

    a1, b, c = run(1, 2, 3)
    (a2,) = run(1)
    assert a1 == a2  # same seed, same tokens
    assert len({a1, b, c}) == 3  # different seeds, different tokens
    n1, n2 = run(None, None)
    assert n1 != n2
