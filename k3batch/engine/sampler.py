"""Per-request sampling: greedy, temperature, top-k, top-p, seeded.

Sampling runs on the CPU (scores in fp64), one row per request, each with its own generator, so a
request's tokens depend only on its own logits and seed, never on the rest of the batch.
"""

import torch

from k3batch.engine.request import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator:
    gen = torch.Generator()
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def sample(logits_V: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """One token from one row of logits [V] (fp32, CPU)."""
    if params.is_greedy:
        return int(torch.argmax(logits_V))
    # fp64 and shifted so the largest score is 0: any temperature > 0 (1e-300 too, which is 0 in
    # fp32) gives 0 there and finite or -inf values elsewhere, never nan.
    scores = (logits_V.double() - logits_V.max()) / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < params.top_p  # smallest set reaching top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))
