"""Sampling a whole batch on the logits' device: greedy, temperature, top-k, top-p, seeds.

A row is sampled by inverting its cumulative distribution (fp64, in vocabulary order) at one
uniform number u drawn from the request's seed and the index of the token being sampled (a
splitmix64 hash, on the host).
So a request's tokens depend only on its own logits, seed and position: never on the rest of the
batch, the device, or whether it was retracted and run again. Filters: top-k keeps the k most
likely tokens, then top-p the smallest set of them whose probability reaches top_p (the first
always kept), renormalized. Only the chosen ids (and their log-probs, of the raw model
distribution, when asked) leave the device, in one copy per call, which `Sampled.result`
waits for.
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


class Sampled:
    """The tokens of one sampled batch: `tokens` on the logits' device (a decode step can feed
    them to the next one there), and a copy on its way to the host, started at once so that
    `result()` waits for this batch only, not for work queued after it."""

    def __init__(self, tokens_B: torch.Tensor, logprobs_B: torch.Tensor | None):
        self.tokens = tokens_B
        self._with_logprobs = logprobs_B is not None
        vals = tokens_B if logprobs_B is None else torch.stack([tokens_B.double(), logprobs_B])
        self._ready = None
        if vals.is_cuda:
            self._host = torch.empty(vals.shape, dtype=vals.dtype, pin_memory=True)
            self._host.copy_(vals, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = vals

    def result(self) -> tuple[list[int], list[float] | None]:
        """(token ids, their log-probs or None) on the host."""
        if self._ready is not None:
            self._ready.synchronize()
        if not self._with_logprobs:
            return self._host.tolist(), None
        both = self._host.tolist()
        return [int(t) for t in both[0]], both[1]


def sample(
    logits_BV: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    positions: list[int],
    *,
    want_logprobs: bool,
) -> Sampled:
    """One token per row, computed where the logits are; nothing waits for the device.
    logits_BV: [B, V]; params, seeds, positions: per row (position = how many tokens the
    request has made before this one). Log-probs (with want_logprobs) are of each token under
    softmax(logits)."""
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
        return Sampled(tokens, None)
    lp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]
    return Sampled(tokens, lp.double())


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
