"""Plain-torch fp32 references for the MLA kernels (the test oracles; any device).

Shape legend: T packed new tokens, S packed keys (cached prefix + new, per sequence), B
sequences, H heads, L latent (kv_lora), R shared rope-key dims, C = L + R (one cached token),
Dn / Dv nope / value head dims, P pages, N split (or rank) partials.
Scores are (q . k) * scale; softmax and sums in fp32; every input is upcast first, so a
reference fed the kernel's (rounded) inputs sees exactly the same values.
"""

import torch


def gather_tokens(pool_PNC, page_rows_BP, seq_lens_B) -> tuple[torch.Tensor, torch.Tensor]:
    """The first seq_lens[b] tokens of every sequence, dense: (latent [B, S, C] in the pool's
    dtype, mask [B, S] True where there is no token), S = max(seq_lens). Reference only: the
    kernels read the pages in place."""
    page_size = pool_PNC.shape[1]
    lens = [int(n) for n in seq_lens_B]
    S = max(lens, default=0)
    pos = torch.arange(S, device=pool_PNC.device)
    rows = page_rows_BP[:, pos // page_size] if S else page_rows_BP[:, :0]
    latent = pool_PNC[rows, (pos % page_size)[None, :]]  # [B, S, C]
    mask = pos[None, :] >= torch.tensor(lens, device=pool_PNC.device)[:, None]
    return latent, mask


def partial_attention(q_BHC, latent_BSC, mask_BS, *, kv_lora: int, scale: float):
    """Absorbed softmax attention of one query per sequence over a subset of its tokens.

    q_BHC: [q_lat | q_rope] [B, H, C]; latent_BSC: [c | k_rope] [B, S, C]; mask_BS True = not a
    token of this subset. Returns (out [B, H, L] fp32 = sum_s p_s c_s / sum_s p_s, lse [B, H]
    fp32 = log sum_s exp(score_s)); an empty subset gives out 0 and lse -inf.
    """
    B, H, _ = q_BHC.shape
    if latent_BSC.shape[1] == 0:
        return q_BHC.new_zeros(B, H, kv_lora).float(), q_BHC.new_full((B, H), -torch.inf).float()
    latent = latent_BSC.float()
    scores = torch.einsum("bhc,bsc->bhs", q_BHC.float(), latent) * scale
    scores = scores.masked_fill(mask_BS[:, None, :], -torch.inf)
    top = scores.amax(-1)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # empty rows: exp -> 0
    p = torch.exp(scores - top[..., None])
    denom = p.sum(-1)  # [B, H]
    out = torch.einsum("bhs,bsl->bhl", p, latent[..., :kv_lora])
    out = out / denom.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    return out, top + torch.log(denom)


def mla_decode(q_BHC, pool_PNC, page_rows_BP, seq_lens_B, *, kv_lora: int, scale: float):
    """Paged absorbed decode: each sequence's query heads over its first seq_lens[b] cached
    tokens (pages page_rows[b]). Returns (out [B, H, L] fp32, lse [B, H] fp32)."""
    latent, mask = gather_tokens(pool_PNC, page_rows_BP, seq_lens_B)
    return partial_attention(q_BHC, latent, mask, kv_lora=kv_lora, scale=scale)


def merge_lse(partials_NXL, lses_NX):
    """Exact combination of N partial attentions over disjoint token sets.

    partials [N, ..., L] (each normalized over its own tokens), lses [N, ...]. With
    lse = log sum_j exp(lse_j): out = sum_j exp(lse_j - lse) partials_j, softmax attention over
    the union. A partial with lse_j = -inf has weight 0. Returns (out [..., L], lse [...]) fp32.
    """
    lses = lses_NX.float()
    top = lses.amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lses - top)  # [N, ...]
    total = w.sum(0)
    out = (w[..., None] * partials_NXL.float()).sum(0) / total.clamp_min(1e-38)[..., None]
    return out, top + torch.log(total)


def mla_prefill(q_THQ, k_nope_SHK, k_rope_SR, v_SHV, cu_seqlens_q, cu_seqlens_k, *, scale: float):
    """Causal expanded attention over packed sequences, each with a cached prefix.

    q_THQ: [T, H, Dn + R] ([q_nope | q_rope]); k_nope [S, H, Dn]; k_rope [S, R] (one key for all
    heads); v [S, H, Dv]; cu_seqlens_q / cu_seqlens_k: B + 1 offsets (lists or tensors). Sequence
    b has k_len - q_len cached tokens before its new ones; new token i sits at position
    k_len - q_len + i and sees keys 0 .. that position. Returns o [T, H, Dv] fp32.
    """
    cu_q, cu_k = [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_k]
    Dn = k_nope_SHK.shape[-1]
    out = q_THQ.new_empty(q_THQ.shape[0], q_THQ.shape[1], v_SHV.shape[-1], dtype=torch.float32)
    for b in range(len(cu_q) - 1):
        q = q_THQ[cu_q[b] : cu_q[b + 1]].float()
        kn, kr = k_nope_SHK[cu_k[b] : cu_k[b + 1]].float(), k_rope_SR[cu_k[b] : cu_k[b + 1]].float()
        v = v_SHV[cu_k[b] : cu_k[b + 1]].float()
        T, S = q.shape[0], kn.shape[0]
        scores = torch.einsum("thd,shd->hts", q[..., :Dn], kn)
        scores = scores + torch.einsum("thr,sr->hts", q[..., Dn:], kr)
        pos_q = torch.arange(T, device=q.device)[:, None] + (S - T)
        mask = torch.arange(S, device=q.device)[None, :] > pos_q
        probs = torch.softmax((scores * scale).masked_fill(mask, -torch.inf), dim=-1)
        out[cu_q[b] : cu_q[b + 1]] = torch.einsum("hts,shv->thv", probs, v)
    return out
