"""Gated MLA with NoPE (spec section 5): expanded attention for prefill, absorbed attention on
the cached latent for decode.

Cached per token: [c_kv normalized (kv_lora) | k^R (rope dims, not normalized, shared by heads)].
The projections of the layer input run as ONE GEMM (`FusedRows`): q_proj (Kimi Linear) or
q_a_proj (K3's q LoRA), kv_a_proj_with_mqa and, with the output gate (K3), g_proj.
Shape legend: T packed tokens, D hidden, H heads, L latent (kv_lora), R rope dims, Dn nope dims,
Dv value dims, S cached tokens, C = L + R, P pages.
Attention runs through `k3kernels.mla` (Triton) on CUDA and its fp32 torch reference
elsewhere (`backend`: "auto", "triton" or "torch"). The cache pages come bound to the batch
(`ForwardBatch.mla_pages`, `page_rows`): this module does not import the cache.
"""

import torch
from torch import nn

from k3batch.model.layers import FusedRows, RMSNorm, linear
from k3kernels.mla import reference as mla_ref


class KimiMLAAttention(nn.Module):
    def __init__(self, config, layer_idx: int, dtype=None, device=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.backend = "auto"  # "triton": the kernels (CUDA, or CPU under TRITON_INTERPRET=1)
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
        # in_proj's output columns: q (or q_a) | c_kv | k^R | output gate (K3)
        names = ["q_proj" if config.q_lora_rank is None else "q_a_proj", "kv_a_proj_with_mqa"]
        self.in_sizes = [config.q_lora_rank or q_out, self.kv_lora, self.rope]
        if config.mla_use_output_gate:
            names.append("g_proj")
            self.in_sizes.append(H * self.v_dim)
        self.in_proj = FusedRows(self, tuple(names))

    def project(self, x_TD):
        """The projections of the layer input, from one GEMM: (q [T, H, Dn + R], the per-token
        cache entry latent [T, L + R], output gate logits [T, H * Dv] (a strided view) or None)."""
        q, c, k_rope, *gate = self.in_proj.linear(x_TD).split(self.in_sizes, dim=-1)
        if hasattr(self, "q_a_proj"):
            q = self.q_b_proj(self.q_a_layernorm(q))
        latent = torch.cat([self.kv_a_layernorm(c), k_rope], dim=-1)
        return q.view(x_TD.shape[0], self.num_heads, -1), latent, gate[0] if gate else None

    def forward(self, x_TD, batch, cache=None):
        """cache is unused here: the MLA pages come bound to the batch (batch.mla_pages)."""
        q_THQ, latent_TC, gate = self.project(x_TD)
        if batch.is_decode:
            ctx_THV = self._decode(q_THQ, latent_TC, batch)
        else:
            ctx_THV = self._prefill(q_THQ, latent_TC, batch)
        ctx = ctx_THV.reshape(x_TD.shape[0], -1)
        if gate is not None:
            ctx = ctx * torch.sigmoid(gate)  # the gate reads the layer input
        return self.o_proj(ctx)

    def uses_kernels(self, t) -> bool:
        return self.backend == "triton" or (self.backend == "auto" and t.is_cuda)

    # ---- absorbed weights: views of kv_b_proj in the model dtype (no copy, no cast) ----------
    @property
    def w_uk(self):
        """[H, Dn, L]: k^N = W_UK c per head."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora)
        return w[:, : self.nope]

    @property
    def w_uv(self):
        """[H, Dv, L]: v = W_UV c per head."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora)
        return w[:, self.nope :]

    def absorb(self, q_BHQ):
        """[B, H, Dn + R] -> [W_UK^T q^N | q^R] [B, H, L + R], one batched GEMM per head in the
        model dtype (fp32 accumulation)."""
        q_nope, q_rope = q_BHQ.split([self.nope, self.rope], dim=-1)
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [B, H, L]
        return torch.cat([q_lat, q_rope], dim=-1)

    def unabsorb(self, ctx_BHL):
        """Latent context [B, H, L] -> per-head values W_UV ctx [B, H, Dv] (model dtype)."""
        ctx = ctx_BHL.to(self.kv_b_proj.weight.dtype).transpose(0, 1)  # [H, B, L]
        return torch.bmm(ctx, self.w_uv.transpose(1, 2)).transpose(0, 1)

    # ---- prefill ------------------------------------------------------------------------------
    def _prefill(self, q_THQ, latent_TC, batch):
        """Expanded causal attention of the packed new tokens over their sequences' cached
        prefix plus themselves, with no per-sequence loop: the new latents go into their pages
        in one scatter, every sequence's whole latent (prefix + new) comes back in one gather,
        one kv_b_proj GEMM expands it and one varlen flash kernel attends (`kernels/mla`).
        Expanding the prefix per chunk costs P * 25 MFLOP (K3: 2 * 512 * 96 * 256 per cached
        token) against T * P * 210 kFLOP for attending it in absorbed form (2 * 96 * (576 + 512)
        per query-key pair, vs 61 kFLOP expanded): cheaper for chunks of more than ~170 tokens,
        which prefill chunks are."""
        dev, pool = q_THQ.device, _pool(batch, self.layer_idx)
        lens, cached = batch.seq_lens, batch.cached_lens
        if pool is None:
            if any(cached):
                raise ValueError(
                    f"MLA layer {self.layer_idx}: cached_lens {cached} need the cache's pages "
                    f"bound to the batch (batch.mla_pages)"
                )
            latent_SC, k_lens, cu_k = latent_TC, lens, None
        else:
            ps = pool.shape[1]
            for n, (new, c) in enumerate(zip(lens, cached)):
                if c + new > len(batch.page_tables[n]) * ps:
                    raise ValueError(
                        f"sequence of {c + new} tokens exceeds its {len(batch.page_tables[n])} "
                        f"pages of {ps} tokens"
                    )
            k_lens = [c + n for c, n in zip(cached, lens)]
            at = batch.token_addresses(dev, ps)  # built by the first MLA layer of the forward
            pool[at.rows_T, at.slots_T] = latent_TC.to(pool.dtype)
            if at.rows_S is not None:
                latent_SC = pool[at.rows_S, at.slots_S]
            else:
                latent_SC = latent_TC.to(pool.dtype)
            cu_k = at.cu_k
        cu_q = batch.varlen(dev).cu if self.uses_kernels(q_THQ) else None
        return self._attend_packed(q_THQ, latent_SC, lens, k_lens, cu_q, cu_k)

    def _attend_packed(self, q_THQ, latent_SC, q_lens, k_lens, cu_q=None, cu_k=None):
        """Expanded attention; cu_q / cu_k: the offsets already on the device (the batch's,
        shared by the layers of a forward), None to copy them from q_lens / k_lens here
        (cu_k None with cu_q given: the keys are the queries)."""
        S, H = latent_SC.shape[0], self.num_heads
        c, k_rope = latent_SC.split([self.kv_lora, self.rope], dim=-1)
        kv = self.kv_b_proj(c).view(S, H, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        if not self.uses_kernels(q_THQ):
            o = mla_ref.mla_prefill(q_THQ, k_nope, k_rope, v, _offsets(q_lens),
                                    _offsets(k_lens), scale=self.scale)  # fmt: skip
            return o.to(q_THQ.dtype)
        from k3kernels.mla.prefill import mla_prefill  # imports triton

        dev = q_THQ.device
        if cu_q is None:
            cu_q = torch.tensor(_offsets(q_lens)).to(dev, non_blocking=True)
        if cu_k is None:
            same = k_lens == q_lens
            cu_k = cu_q if same else torch.tensor(_offsets(k_lens)).to(dev, non_blocking=True)
        return mla_prefill(q_THQ, k_nope, k_rope, v, cu_q, cu_k,
                           max_seqlen_q=max(q_lens, default=0), scale=self.scale)  # fmt: skip

    def attend_expanded(self, q_THQ, latent_SC, offset: int):
        """Causal attention of T queries at positions offset.. over S = offset + T latents
        (one sequence, keys and values expanded through kv_b_proj)."""
        return self._attend_packed(q_THQ, latent_SC, [q_THQ.shape[0]], [latent_SC.shape[0]])

    # ---- decode -------------------------------------------------------------------------------
    def _decode(self, q_BHQ, latent_BC, batch):
        """One new token per sequence: its latent goes into its page, then absorbed attention
        over every sequence's pages in place (`kernels/mla/decode.py`; fp32 reference on CPU):
        score = (W_UK^T q^N) . c + q^R . k^R, ctx = W_UV (sum p c)."""
        pool = _pool(batch, self.layer_idx)
        if pool is None:
            raise ValueError(f"MLA layer {self.layer_idx}: decode needs batch.mla_pages")
        at = batch.decode_addresses(pool.shape[1])  # the first MLA layer's, shared
        pool[at.rows_B, at.slots_B] = latent_BC.to(pool.dtype)
        ctx_BHL, _ = self.attend_pages(
            self.absorb(q_BHQ), pool, batch.page_rows, at.seq_lens_B, batch.max_len
        )
        return self.unabsorb(ctx_BHL)

    def attend_pages(self, q_BHC, pool_PNC, page_rows_BP, seq_lens_B, max_len: int, *,
                     out_dtype=None):  # fmt: skip
        """Absorbed attention of q [B, H, L + R] over each sequence's first seq_lens[b] tokens
        in its pages. max_len: host bound on seq_lens (sizes the split). Returns (ctx [B, H, L]
        in out_dtype (default q's), lse [B, H] fp32)."""
        kw = dict(kv_lora=self.kv_lora, scale=self.scale)
        if not self.uses_kernels(q_BHC):
            o, lse = mla_ref.mla_decode(q_BHC, pool_PNC, page_rows_BP, seq_lens_B, **kw)
            return o.to(out_dtype or q_BHC.dtype), lse
        from k3kernels.mla.decode import mla_decode, num_splits_for  # imports triton

        B, H = q_BHC.shape[:2]
        splits = num_splits_for(B, H, max_len)
        return mla_decode(q_BHC, pool_PNC, page_rows_BP, seq_lens_B, num_splits=splits,
                          out_dtype=out_dtype, **kw)  # fmt: skip

    def attend_absorbed(self, q_BHQ, latent_BSC, mask_BS):
        """Absorbed attention of one query per sequence over dense latents (True in mask =
        skip); the fp32 reference form, for tests."""
        o, _ = mla_ref.partial_attention(
            self.absorb(q_BHQ), latent_BSC, mask_BS, kv_lora=self.kv_lora, scale=self.scale
        )
        return self.unabsorb(o)


def _pool(batch, layer_idx: int):
    return None if batch.mla_pages is None else batch.mla_pages.get(layer_idx)


def _offsets(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out
