"""Decode context parallelism (DCP) for MLA: the cached latent of a sequence is striped over the
M ranks of a DCP group, and one decode step attends every stripe and merges the partials exactly.

Ownership: token i lives only on the rank with dcp_rank == i % M, at local index i // M of its
`mla_latent[layer][slot]` (capacity ceil(max_seq_len / M)). One decode step of one MLA layer:
1. each rank absorbs its heads' queries into the latent space ([W_UK^T q^N | q^R], in the
   model dtype) and the DCP group all-gathers them: every rank now has the queries of the
   group's M * H/N heads;
2. the owner of the new token (position cached_len) writes its latent;
3. each rank attends its local tokens for all the group's heads, in place in its pages (the
   paged decode kernel of `k3kernels.mla` on CUDA): a partial latent context (normalized over
   its own tokens, fp32) and a log-sum-exp per head (-inf with no token);
4. ONE packed all-to-all returns to each rank the partials and LSEs of its own heads from all
   M ranks; the LSE merge (`k3kernels.mla.merge` on CUDA, `merge_lse` elsewhere) combines
   them into the full softmax attention, then W_UV.
With M = 1 the single-device absorbed decode runs unchanged. Prefill on a rank with M > 1 is
not supported (the prefill side builds full caches and reshards them: `parallel/handoff.py`).
Shape legend: B sequences, H heads, S tokens, L latent (kv_lora), R rope dims, C = L + R,
M DCP ranks.
"""

import torch

from k3batch.model.mla import KimiMLAAttention
from k3batch.parallel.group import ParallelGroup
from k3kernels.mla.reference import merge_lse, partial_attention

__all__ = ["ContextParallelMLA", "merge_lse", "partial_attention"]  # the references, for tests


class ContextParallelMLA(KimiMLAAttention):
    """KimiMLAAttention of one rank: built from the rank's local config (its H/N heads), with
    the decode step of the module docstring over the DCP group `dcp`."""

    def __init__(self, config, layer_idx: int, dcp: ParallelGroup, dtype=None, device=None):
        super().__init__(config, layer_idx, dtype, device)
        self.dcp = dcp

    def _prefill(self, q_THQ, latent_TC, batch):
        if self.dcp.size > 1:
            raise ValueError(
                f"MLA layer {self.layer_idx}: a rank with dcp_size = {self.dcp.size} runs decode "
                f"only (one token per sequence, every cached_len > 0); got seq_lens "
                f"{batch.seq_lens}, cached_lens {batch.cached_lens}"
            )
        return super()._prefill(q_THQ, latent_TC, batch)

    def _decode(self, q_BHQ, latent_BC, batch):
        if self.dcp.size == 1:
            return super()._decode(q_BHQ, latent_BC, batch)
        M, d = self.dcp.size, self.dcp.rank
        B, H, L = q_BHQ.shape[0], self.num_heads, self.kv_lora
        pool = batch.mla_pages[self.layer_idx]  # [P, page_size, C]: local tokens in pages
        ps = pool.shape[1]
        # On the device, no host sync: every rank writes a row for every sequence, the owner its
        # new latent, the others the value already there (token p's local index p // M has a
        # page on every rank: bind checked the owner's, and the others' stripes are as long).
        pos_B = batch.positions  # global position of each new token
        local_B = pos_B // M
        rows_B = batch.page_rows.gather(1, (local_B // ps)[:, None])[:, 0]
        slot_B = local_B % ps
        own_B = (pos_B % M == d)[:, None]
        pool[rows_B, slot_B] = torch.where(own_B, latent_BC.to(pool.dtype), pool[rows_B, slot_B])

        q_group = self.dcp.all_gather(self.absorb(q_BHQ), dim=1)  # [B, M * H, C], rank order
        # Local tokens i <= p with i % M == d; ceil(max_len / M) bounds them (split sizing).
        lens = torch.where(pos_B >= d, (pos_B - d) // M + 1, 0).to(torch.int32)
        out, lse = self.attend_pages(
            q_group, pool, batch.page_rows, lens, -(-batch.max_len // M), out_dtype=torch.float32
        )  # [B, M * H, L] fp32, [B, M * H]
        packed = torch.cat([out, lse[..., None]], dim=-1).view(B, M, H, L + 1)
        recv = self.dcp.all_to_all(list(packed.transpose(0, 1).contiguous().unbind(0)))
        parts = torch.stack(recv)  # [M, B, H, L + 1]: my heads, from every DCP rank
        if self.uses_kernels(parts):
            from k3kernels.mla.merge import merge_lse as merge  # imports triton
        else:
            merge = merge_lse
        ctx_lat, _ = merge(parts[..., :L], parts[..., L])
        return self.unabsorb(ctx_lat)
