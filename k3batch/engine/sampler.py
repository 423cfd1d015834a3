"""Sampling a whole batch on the logits' device: greedy, temperature, top-k, top-p, seeds.

A row is sampled by inverting its cumulative distribution (fp64, in vocabulary order) at one
uniform number u drawn from the request's seed and the index of the token being sampled (a
splitmix64 hash, on the host).
So a request's tokens depend only on its own logits, seed and position: never on the rest of the
batch, the device, or whether it was retracted and run again. Filters: top-k keeps the k most
likely tokens, then top-p the smallest set of them whose probability reaches top_p (the first
always kept), renormalized. Only the chosen ids (and their log-probs, of the raw model
distribution, when asked) leave the device, in one copy per call.
Shape legend: B rows, V vocabulary.
"""

import random

import torch

from k3batch.engine.request import Request, SamplingParams

_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """The uniform number in (0, 1) that picks token `position` of a request with `seed`."""
    bits = _splitmix64(_splitmix64(seed & _M64) ^ position) >> 11  # 53 bits
    return (bits + 0.5) / (1 << 53)


def draw_seed() -> int:
    """A seed for a request that has none (its samples still vary from run to run)."""
    return random.SystemRandom().getrandbits(63)


def sample_batch(
    logits_BV: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    positions: list[int],
    *,
    want_logprobs: bool,
) -> tuple[list[int], list[float] | None]:
    """One token per row. logits_BV: [B, V] on any device; params, seeds, positions: per row
    (position = how many tokens the request has made). Returns (token ids, log p of each
    token under softmax(logits) or None)."""
    B, V = logits_BV.shape
    dev = logits_BV.device
    logits = logits_BV.float()
    tokens = torch.argmax(logits, dim=-1)
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if rows:
        idx = torch.tensor(rows, device=dev)
        temp = torch.tensor([params[i].temperature for i in rows], device=dev, dtype=torch.float64)
        # fp64, shifted so the largest score is 0: any temperature > 0 (1e-300 too) gives 0
        # there and finite or -inf values elsewhere, never nan.
        scores = logits[idx].double()
        scores = (scores - scores.max(-1, keepdim=True).values) / temp[:, None]
        probs = torch.softmax(scores, dim=-1)
        if any(params[i].top_k > 0 or params[i].top_p < 1 for i in rows):
            # Filter in sorted order, then keep every token at least as likely as the last one
            # kept: sampling stays in vocabulary order, whatever the other rows ask for.
            sorted_p = torch.sort(probs, dim=-1, descending=True).values
            rank = torch.arange(V, device=dev)[None, :]
            k = torch.tensor([params[i].top_k or V for i in rows], device=dev)
            kept = sorted_p.masked_fill(rank >= k[:, None], 0.0)
            kept = kept / kept.sum(-1, keepdim=True)
            top_p = torch.tensor([params[i].top_p for i in rows], device=dev, dtype=torch.float64)
            before = kept.cumsum(-1) - kept  # mass of the more likely tokens
            keep = (rank < k[:, None]) & ((before < top_p[:, None]) | (rank == 0))
            last = sorted_p.gather(-1, (keep.sum(-1, keepdim=True) - 1))
            probs = probs.masked_fill(probs < last, 0.0)
        cdf = probs.cumsum(-1)
        u = torch.tensor([uniform(seeds[i], positions[i]) for i in rows], device=dev)
        pick = torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None]).clamp_(max=V - 1)
        tokens[idx] = pick[:, 0]
    if not want_logprobs:
        return tokens.tolist(), None
    lp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]
    both = torch.stack([tokens.double(), lp.double()]).tolist()  # one copy to the host
    return [int(t) for t in both[0]], both[1]


def add_prompt_logprobs(req: Request, rows_TV, start: int, n: int) -> None:
    """Append to req the log-probs (and greedy flags) of its prompt tokens that rows_TV score:
    logits at prompt positions start .. start+n-1, each row scoring the next token. Keeps the
    positions from prompt_logprobs_start on (position 0: None)."""
    first = req.sampling.prompt_logprobs_start
    if start == 0 and first == 0:
        req.prompt_logprobs.append(None)
        req.prompt_greedy.append(None)
    lo = max(start, first - 1)  # the first row whose target is scored
    targets = req.prompt_token_ids[lo + 1 : start + n + 1]
    if not targets:
        return
    rows = rows_TV[lo - start : lo - start + len(targets)].float()
    lp = torch.log_softmax(rows, dim=-1)
    tgt = torch.tensor(targets, device=lp.device)
    both = torch.stack([lp.gather(-1, tgt[:, None])[:, 0].double(),
                        (rows.argmax(-1) == tgt).double()]).tolist()  # fmt: skip
    req.prompt_logprobs.extend(both[0])
    req.prompt_greedy.extend(bool(g) for g in both[1])
