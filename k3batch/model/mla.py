"""Gated MLA with NoPE (spec section 5): expanded attention for prefill, absorbed attention on
the cached latent for decode.

Cached per token: [c_kv normalized (kv_lora) | k^R (rope dims, not normalized, shared by heads)].
Shape legend: T packed tokens, D hidden, H heads, L latent (kv_lora), R rope dims, Dn nope dims,
Dv value dims, S cached tokens.
"""

import torch
import torch.nn.functional as F
from torch import nn

from k3batch.cache.paged import load_tokens, store_tokens
from k3batch.model.layers import RMSNorm, linear


class KimiMLAAttention(nn.Module):
    def __init__(self, config, layer_idx: int, dtype=None, device=None):
        super().__init__()
        self.layer_idx = layer_idx
        D, H = config.hidden_size, config.num_attention_heads
        self.num_heads = H
        self.nope, self.rope, self.v_dim = (
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.v_head_dim,
        )
        self.kv_lora = config.kv_lora_rank
        self.scale = config.q_head_dim**-0.5
        q_out = H * config.q_head_dim
        if config.q_lora_rank is None:
            self.q_proj = linear(D, q_out, dtype, device)
        else:
            self.q_a_proj = linear(D, config.q_lora_rank, dtype, device)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.mla_norm_eps, dtype, device)
            self.q_b_proj = linear(config.q_lora_rank, q_out, dtype, device)
        self.kv_a_proj_with_mqa = linear(D, self.kv_lora + self.rope, dtype, device)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, config.mla_norm_eps, dtype, device)
        self.kv_b_proj = linear(self.kv_lora, H * (self.nope + self.v_dim), dtype, device)
        self.o_proj = linear(H * self.v_dim, D, dtype, device)
        if config.mla_use_output_gate:
            self.g_proj = linear(D, H * self.v_dim, dtype, device)

    def _query(self, x_TD):
        if hasattr(self, "q_proj"):
            q = self.q_proj(x_TD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_TD)))
        return q.view(x_TD.shape[0], self.num_heads, self.nope + self.rope)

    def _latent(self, x_TD):
        """[T, L + R]: the per-token cache entry."""
        c, k_rope = self.kv_a_proj_with_mqa(x_TD).split([self.kv_lora, self.rope], dim=-1)
        return torch.cat([self.kv_a_layernorm(c), k_rope], dim=-1)

    def forward(self, x_TD, batch, cache=None):
        q_THQ = self._query(x_TD)
        latent_TC = self._latent(x_TD)
        if batch.is_decode:
            ctx_THV = self._decode(q_THQ, latent_TC, batch, cache)
        else:
            ctx_THV = self._prefill(q_THQ, latent_TC, batch, cache)
        ctx = ctx_THV.reshape(x_TD.shape[0], -1)
        if hasattr(self, "g_proj"):
            ctx = ctx * torch.sigmoid(self.g_proj(x_TD))  # the gate reads the layer input
        return self.o_proj(ctx)

    def _prefill(self, q_THQ, latent_TC, batch, cache):
        """Expanded attention per sequence over its cached tokens plus the new ones."""
        out = []
        for n, (start, end) in enumerate(zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:])):
            new = latent_TC[start:end]
            cached = batch.cached_lens[n]
            if cache is not None:
                pool, rows = cache.mla_latent[self.layer_idx], batch.page_rows[n]
                total = cached + end - start
                if total > len(batch.page_tables[n]) * pool.shape[1]:
                    raise ValueError(
                        f"sequence of {total} tokens exceeds its {len(batch.page_tables[n])} "
                        f"pages of {pool.shape[1]} tokens"
                    )
                store_tokens(pool, rows, cached, new)
                full = load_tokens(pool, rows[None], total)[0]
            else:
                assert cached == 0, "a cached prefix needs a cache"
                full = new
            out.append(self.attend_expanded(q_THQ[start:end], full, cached))
        return torch.cat(out)

    def attend_expanded(self, q_THQ, latent_SC, offset: int):
        """Causal attention of T queries at positions offset.. over S = offset + T latents,
        with per-head keys and values expanded through kv_b_proj. fp32 softmax."""
        T, S, H = q_THQ.shape[0], latent_SC.shape[0], self.num_heads
        c, k_rope = latent_SC.split([self.kv_lora, self.rope], dim=-1)
        kv = self.kv_b_proj(c).view(S, H, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        if q_THQ.is_cuda:  # fused SDPA in the model dtype; the fp32 path below is the reference
            k = torch.cat([k_nope, k_rope[:, None, :].expand(S, H, self.rope)], dim=-1)
            keep = torch.arange(S, device=q_THQ.device)[None, :] <= (
                torch.arange(T, device=q_THQ.device)[:, None] + offset
            )
            out = F.scaled_dot_product_attention(
                q_THQ.transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=keep,
                scale=self.scale,
            )
            return out.transpose(0, 1)
        q_nope, q_rope = q_THQ.split([self.nope, self.rope], dim=-1)
        scores = torch.einsum("thd,shd->hts", q_nope.float(), k_nope.float())
        scores = scores + torch.einsum("thr,sr->hts", q_rope.float(), k_rope.float())
        pos_q = torch.arange(T, device=q_THQ.device)[:, None] + offset
        mask = torch.arange(S, device=q_THQ.device)[None, :] > pos_q
        probs = torch.softmax((scores * self.scale).masked_fill(mask, float("-inf")), dim=-1)
        return torch.einsum("hts,shv->thv", probs, v.float()).to(q_THQ.dtype)

    def _decode(self, q_BHQ, latent_BC, batch, cache):
        """One new token per sequence, attention in the latent space (absorbed form):
        score = (W_UK^T q^N) . c + q^R . k^R; ctx = W_UV (sum p c)."""
        dev = q_BHQ.device
        pool = cache.mla_latent[self.layer_idx]
        ps = pool.shape[1]
        pos = list(batch.cached_lens)
        if any(p // ps >= len(t) for p, t in zip(pos, batch.page_tables)):
            raise ValueError("a sequence has no page for its next token")
        pos_B = torch.tensor(pos, device=dev)
        rows_B = batch.page_rows.gather(1, (pos_B // ps)[:, None])[:, 0]
        pool[rows_B, pos_B % ps] = latent_BC.to(pool.dtype)
        S = max(pos) + 1
        latent_BSC = load_tokens(pool, batch.page_rows, S)
        mask = torch.arange(S, device=dev)[None, :] > pos_B[:, None]  # [B, S]
        return self.attend_absorbed(q_BHQ, latent_BSC, mask)

    def attend_absorbed(self, q_BHQ, latent_BSC, mask_BS):
        """Absorbed attention of one query per sequence over S latents (True in mask = skip)."""
        H = self.num_heads
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.kv_lora)
        w_uk, w_uv = w.float().split([self.nope, self.v_dim], dim=1)  # [H, Dn, L], [H, Dv, L]
        q_nope, q_rope = q_BHQ.float().split([self.nope, self.rope], dim=-1)
        q_lat = torch.einsum("bhd,hdl->bhl", q_nope, w_uk)
        c, k_rope = latent_BSC.float().split([self.kv_lora, self.rope], dim=-1)
        scores = torch.einsum("bhl,bsl->bhs", q_lat, c) + torch.einsum(
            "bhr,bsr->bhs", q_rope, k_rope
        )
        scores = (scores * self.scale).masked_fill(mask_BS[:, None, :], float("-inf"))
        ctx_lat = torch.einsum("bhs,bsl->bhl", torch.softmax(scores, dim=-1), c)
        return torch.einsum("bhl,hvl->bhv", ctx_lat, w_uv).to(q_BHQ.dtype)
