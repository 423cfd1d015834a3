"""Decode context parallelism (DCP) for MLA: the cached latent of a sequence is striped over the
M ranks of a DCP group, and one decode step attends every stripe and merges the partials exactly.

Ownership: token i lives only on the rank with dcp_rank == i % M, at local index i // M of its
`mla_latent[layer][slot]` (capacity ceil(max_seq_len / M)). One decode step of one MLA layer:
1. each rank absorbs its heads' queries into the latent space ([W_UK^T q^N | q^R], fp32) and
   the DCP group all-gathers them: every rank now has the queries of the group's M * H/N heads;
2. the owner of the new token (position cached_len) writes its latent;
3. each rank attends its local tokens for all the group's heads: a partial latent context
   (normalized over its own tokens) and a log-sum-exp per head (-inf with no token);
4. ONE packed all-to-all returns to each rank the partials and LSEs of its own heads from all
   M ranks; `merge_lse` combines them into the full softmax attention, then W_UV.
With M = 1 the single-device absorbed decode runs unchanged. Prefill on a rank with M > 1 is
not supported (the prefill side builds full caches and reshards them: `parallel/handoff.py`).
Shape legend: B sequences, H heads, S tokens, L latent (kv_lora), R rope dims, C = L + R,
M DCP ranks.
"""

import torch

from k3batch.cache.paged import load_tokens
from k3batch.model.mla import KimiMLAAttention
from k3batch.parallel.group import ParallelGroup


def partial_attention(q_BHC, latent_BSC, mask_BS, *, kv_lora: int, scale: float):
    """Softmax attention of absorbed queries over a subset of the tokens.

    q_BHC: [q_lat | q_rope] fp32 [B, H, C]; latent_BSC: [c | k_rope] [B, S, C]; mask_BS: True
    = not a token of this subset. Returns (out [B, H, L] fp32, normalized over this subset's
    tokens: sum_s p_s c_s / sum_s p_s; lse [B, H] fp32 = log sum_s exp(score_s), -inf (and out
    0) where the subset is empty). score = (q . latent) * scale.
    """
    B, H, _ = q_BHC.shape
    if latent_BSC.shape[1] == 0:
        zeros = q_BHC.new_zeros(B, H, kv_lora)
        return zeros, q_BHC.new_full((B, H), float("-inf"))
    latent = latent_BSC.float()
    scores = torch.einsum("bhc,bsc->bhs", q_BHC, latent) * scale
    scores = scores.masked_fill(mask_BS[:, None, :], float("-inf"))
    top = scores.amax(-1)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # empty rows: exp -> 0
    p = torch.exp(scores - top[..., None])
    denom = p.sum(-1)  # [B, H]
    out = torch.einsum("bhs,bsl->bhl", p, latent[..., :kv_lora])
    out = out / denom.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    return out, top + torch.log(denom)


def merge_lse(partials, lses):
    """Exact combination of M partial attentions over disjoint token sets.

    partials [M, ..., L] (each normalized over its own tokens), lses [M, ...]. With
    lse = log sum_j exp(lse_j), the merged output is
        out = sum_j exp(lse_j - lse) * partials_j,
    which equals softmax attention over the union of the tokens. Computed with the max
    subtracted; a partial with lse_j = -inf (no tokens) has weight 0. Returns (out [..., L],
    lse [...]) in fp32.
    """
    lses = lses.float()
    top = lses.amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lses - top)  # [M, ...]
    total = w.sum(0)
    out = (w[..., None] * partials.float()).sum(0) / total[..., None]
    return out, top + torch.log(total)


class ContextParallelMLA(KimiMLAAttention):
    """KimiMLAAttention of one rank: built from the rank's local config (its H/N heads), with
    the decode step of the module docstring over the DCP group `dcp`."""

    def __init__(self, config, layer_idx: int, dcp: ParallelGroup, dtype=None, device=None):
        super().__init__(config, layer_idx, dtype, device)
        self.dcp = dcp

    def _prefill(self, q_THQ, latent_TC, batch, cache):
        if self.dcp.size > 1:
            raise ValueError(
                f"MLA layer {self.layer_idx}: a rank with dcp_size = {self.dcp.size} runs decode "
                f"only (one token per sequence, every cached_len > 0); got seq_lens "
                f"{batch.seq_lens}, cached_lens {batch.cached_lens}"
            )
        return super()._prefill(q_THQ, latent_TC, batch, cache)

    def _decode(self, q_BHQ, latent_BC, batch, cache):
        if self.dcp.size == 1:
            return super()._decode(q_BHQ, latent_BC, batch, cache)
        M, d, dev = self.dcp.size, self.dcp.rank, q_BHQ.device
        B, H, L = q_BHQ.shape[0], self.num_heads, self.kv_lora
        pool = cache.mla_latent[self.layer_idx]  # [P, page_size, C]: local tokens in pages
        ps = pool.shape[1]
        pos = list(batch.cached_lens)  # global position of each new token
        if any((p // M) // ps >= len(t) for p, t in zip(pos, batch.page_tables)):
            raise ValueError(
                f"a sequence has no page for its next token (local position = position // "
                f"dcp_size {M}, pages of {ps} local tokens)"
            )
        own = [b for b, p in enumerate(pos) if p % M == d]
        if own:  # only the owner stores the new token
            idx = torch.tensor(own, device=dev)
            local = torch.tensor([pos[b] // M for b in own], device=dev)
            rows = batch.page_rows[idx].gather(1, (local // ps)[:, None])[:, 0]
            pool[rows, local % ps] = latent_BC[idx].to(pool.dtype)

        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, L)
        w_uk, w_uv = w.float().split([self.nope, self.v_dim], dim=1)  # [H, Dn, L], [H, Dv, L]
        q_nope, q_rope = q_BHQ.float().split([self.nope, self.rope], dim=-1)
        q_BHC = torch.cat([torch.einsum("bhd,hdl->bhl", q_nope, w_uk), q_rope], dim=-1)
        q_group = self.dcp.all_gather(q_BHC, dim=1)  # [B, M * H, C], heads in DCP-rank order

        num_local = [(p - d) // M + 1 if p >= d else 0 for p in pos]  # tokens i <= p, i % M == d
        S = max(num_local)
        mask = torch.arange(S, device=dev)[None, :] >= torch.tensor(num_local, device=dev)[:, None]
        out, lse = partial_attention(
            q_group, load_tokens(pool, batch.page_rows, S), mask, kv_lora=L, scale=self.scale
        )  # [B, M * H, L], [B, M * H]
        packed = torch.cat([out, lse[..., None]], dim=-1).view(B, M, H, L + 1)
        recv = self.dcp.all_to_all(list(packed.transpose(0, 1).contiguous().unbind(0)))
        parts = torch.stack(recv)  # [M, B, H, L + 1]: my heads, from every DCP rank
        ctx_lat, _ = merge_lse(parts[..., :L], parts[..., L])
        return torch.einsum("bhl,hvl->bhv", ctx_lat, w_uv).to(q_BHQ.dtype)
