"""top-k and top-p together: top-p cuts the top-k survivors' renormalised probabilities.

Without the renormalisation the survivors' cumulative mass stays below top_p longer and top-p
keeps too many tokens. Both tests fail when `kept = kept / kept.sum(-1, keepdim=True)` is
dropped from `sample`: the case below then keeps 3 tokens instead of 2. The chi-square tests in
test_sampler_seeds.py set one filter at a time, where the renormalisation changes nothing.
"""

import math

import torch

from k3batch.engine.request import SamplingParams
from k3batch.engine.sampler import sample, uniform

# Probabilities at temperature 1, in shuffled vocabulary order (sampling runs in vocabulary
# order, filtering in sorted order). By rank: 0.40 (id 3), 0.20 (id 0), 0.15 (id 5), 0.11,
# 0.09, 0.05. top_k=3 keeps ids {3, 0, 5}, mass 0.75; renormalised 0.533, 0.267, 0.2, so the
# mass before each is 0, 0.533, 0.8 and top_p=0.7 keeps {3, 0}. Unrenormalised it is
# 0, 0.40, 0.60: all three stay.
PROBS = [0.20, 0.11, 0.05, 0.40, 0.09, 0.15]
LOGITS = torch.tensor([PROBS]).log()
BOTH = SamplingParams(temperature=1.0, top_k=3, top_p=0.7)
KEPT = {3, 0}


def _kept(probs: list[float], top_k: int, top_p: float, *, renormalise: bool) -> set[int]:
    """The reference filter: the top_k most likely ids, then the fewest of them whose mass
    (renormalised over the top_k, or not) reaches top_p; the first always stays."""
    order = sorted(range(len(probs)), key=lambda t: -probs[t])[: top_k or len(probs)]
    total = sum(probs[t] for t in order) if renormalise else 1.0
    kept, before = set(), 0.0
    for t in order:
        if kept and before >= top_p:
            break
        kept.add(t)
        before += probs[t] / total
    return kept


def _draw(n: int, params: SamplingParams = BOTH) -> list[int]:
    """n draws, seeds 0..n-1 at position 0, one row each."""
    toks, _ = sample(LOGITS.expand(n, len(PROBS)), [params] * n, list(range(n)), [0] * n,
                     want_logprobs=False).result()  # fmt: skip
    return toks


def test_top_p_cuts_the_renormalised_top_k_exactly():
    """Every draw is the inverse CDF, in vocabulary order, of the renormalised kept set at the
    draw's own uniform number; so the sampled ids are exactly KEPT."""
    assert _kept(PROBS, 3, 0.7, renormalise=True) == KEPT
    assert _kept(PROBS, 3, 0.7, renormalise=False) == {3, 0, 5}  # the case tells them apart
    probs = torch.softmax(LOGITS[0].double(), -1).tolist()
    mass = sum(probs[t] for t in KEPT)
    n = 2000
    expect = []
    for seed in range(n):
        target, cdf = uniform(seed, 0), 0.0
        for t, p in enumerate(probs):
            cdf += p / mass if t in KEPT else 0.0
            if cdf >= target:
                break
        expect.append(t)
    toks = _draw(n)
    assert set(toks) == KEPT
    assert toks == expect


def test_top_k_then_top_p_follows_the_renormalised_distribution():
    """Chi-square over the kept ids, 6,000 draws (one seed each): expected frequencies are the
    kept probabilities renormalised; p < 1e-4 fails. A filtered id must never be drawn."""
    n = 6000
    counts = torch.bincount(torch.tensor(_draw(n)), minlength=len(PROBS)).double()
    kept = sorted(KEPT)
    assert counts.sum() == counts[kept].sum(), f"a filtered id was drawn: {counts.tolist()}"
    p = torch.tensor([PROBS[t] for t in kept], dtype=torch.float64)
    e = p / p.sum() * n
    chi2 = float(((counts[kept] - e) ** 2 / e).sum())
    dof = len(kept) - 1
    # Wilson-Hilferty: upper 1e-4 quantile of chi-square with dof degrees of freedom.
    z = 3.719
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, f"chi2 = {chi2:.1f} over {dof} dof (limit {limit:.1f})"
