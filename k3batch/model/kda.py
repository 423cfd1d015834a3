"""KDA layer (Kimi Delta Attention), K3 and Kimi Linear variants (spec section 4).

Projections, short convs and gates live here; the recurrence itself is `k3batch.ops.kda`.
Launches per layer: ONE GEMM of x for every projection that reads it (`in_proj`: q, k, v, the
output gate g (K3) or its down-projection g_a (Kimi Linear), f_a and b, as row blocks of one
weight, `FusedRows`), then f_b (K3), or f_b and g_b as one batched GEMM over the stacked pair
(Kimi Linear), ONE short conv over the q|k|v columns (the three conv weights fused the same
way; the conv cache per block is [3, C, W-1], i.e. [3C, W-1]; at prefill it also L2-norms q
and k), the recurrence, the gated norm and o_proj.
Shape legend: T packed tokens, N sequences, D hidden, H heads, K = V head dim, C = H * K.
"""

import torch
from torch import nn

from k3batch.model.layers import FusedRows, RMSNorm, linear
from k3batch.ops import kda as ops


class KimiDeltaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, dtype=None, device=None):
        super().__init__()
        self.layer_idx = layer_idx
        D, H, K = config.hidden_size, config.kda_num_heads, config.kda_head_dim
        C, W = H * K, config.short_conv_kernel_size
        self.num_heads, self.head_dim = H, K
        self.lower_bound = config.gate_lower_bound
        self.backend = "torch"
        self.q_proj, self.k_proj, self.v_proj = (linear(D, C, dtype, device) for _ in range(3))
        # Conv weights, A_log and dt_bias stay fp32 as in the checkpoint.
        f32 = dict(dtype=torch.float32, device=device)
        self.q_conv1d = nn.Conv1d(C, C, W, groups=C, bias=False, **f32)
        self.k_conv1d = nn.Conv1d(C, C, W, groups=C, bias=False, **f32)
        self.v_conv1d = nn.Conv1d(C, C, W, groups=C, bias=False, **f32)
        self.A_log = nn.Parameter(torch.zeros(H, **f32))  # one per head (spec 14.2)
        self.dt_bias = nn.Parameter(torch.zeros(C, **f32))
        self.f_a_proj = linear(D, K, dtype, device)
        self.f_b_proj = linear(K, C, dtype, device)
        self.b_proj = linear(D, H, dtype, device)
        self.full_rank_gate = config.kda_full_rank_gate
        if self.full_rank_gate:
            self.g_proj = linear(D, C, dtype, device)
            gate = ("g_proj", "f_a_proj")  # in_proj columns: q | k | v | g | f_a | b
        else:
            self.g_a_proj = linear(D, K, dtype, device)
            self.g_b_proj = linear(K, C, dtype, device)
            gate = ("f_a_proj", "g_a_proj")  # q | k | v | f_a | g_a | b: the bmm's pair
            self.fg_b = FusedRows(self, ("f_b_proj", "g_b_proj"))
        self.o_norm = RMSNorm(K, config.rms_norm_eps, dtype, device)  # weight shared by heads
        self.o_proj = linear(C, D, dtype, device)
        self.in_proj = FusedRows(self, ("q_proj", "k_proj", "v_proj", *gate, "b_proj"))
        self.conv = FusedRows(self, ("q_conv1d", "k_conv1d", "v_conv1d"))

    def _project(self, x_TD):
        """(q|k|v [T, 3C] before the conv (a strided view), f [T, H, K] raw decay logits,
        b [T, H] raw beta logits (strided, x's dtype), z [T, H, K] output gate logits)."""
        T, H, K = x_TD.shape[0], self.num_heads, self.head_dim
        C = H * K
        y = self.in_proj.linear(x_TD)
        qkv, b = y[:, : 3 * C], y[:, -H:]
        if self.full_rank_gate:
            z, f = y[:, 3 * C : 4 * C], self.f_b_proj(y[:, 4 * C : 4 * C + K])
        else:
            # f_b(f_a) and g_b(g_a) as one batched GEMM: [2, T, K] x [2, K, C] -> [2, T, C].
            fg_a = y[:, 3 * C : 3 * C + 2 * K].view(T, 2, K).transpose(0, 1)
            f, z = torch.bmm(fg_a, self.fg_b.weight().view(2, C, K).transpose(1, 2))
        return qkv, f.view(T, H, K), b, z.view(T, H, K)

    def forward(self, x_TD, batch, cache=None):
        T = x_TD.shape[0]
        H, K = self.num_heads, self.head_dim
        qkv, f, b, z = self._project(x_TD)
        conv_3CW = self.conv.weight()[:, 0]
        gate = dict(lower_bound=self.lower_bound, scale=K**-0.5, backend=self.backend)
        if batch.is_decode and cache is not None:
            # In place on the cache: each sequence's conv and recurrent state are read from and
            # written to its KDA block, with no gather and no new state tensor.
            slots = batch.slots
            pool = cache.kda_conv[self.layer_idx].flatten(1, 2)  # [NB, 3C, W-1]
            qkv = ops.short_conv_decode_(qkv, conv_3CW, pool, slots, backend=self.backend)
            q, k, v = qkv.view(T, 3, H, K).unbind(1)  # views: the kernel takes row strides
            o = ops.kda_decode_(
                q,
                k,
                v,
                f,
                b,
                self.A_log,
                self.dt_bias,
                state_pool=cache.kda_state[self.layer_idx],
                slots=slots,
                **gate,
            )
        else:
            o = self._prefill(qkv, conv_3CW, f, b, batch, cache, gate)
        y = ops.gated_rms_norm(
            o.to(x_TD.dtype), z, self.o_norm.weight, self.o_norm.eps, backend=self.backend
        )
        return self.o_proj(y.reshape(T, H * K))

    def warm_up(self, max_tokens: int) -> None:
        """Tune ahead whatever the backend tunes by token count, for batches of up to
        max_tokens tokens (`ops.warm_up`)."""
        w = self.o_norm.weight
        ops.warm_up(max_tokens * self.num_heads, self.head_dim, w.dtype, w.device,
                    backend=self.backend)  # fmt: skip

    def _prefill(self, qkv, conv_3CW, f, b, batch, cache, gate):
        """Chunks of whole sequences. With a cache, in place: each sequence continues from the
        conv and recurrent states in its KDA block if it has a cached prefix (from zeros
        otherwise: a fresh block holds stale bytes) and leaves its final states there. Without
        one (a one-shot forward), from zeros."""
        T = qkv.shape[0]
        H, K = self.num_heads, self.head_dim
        # The offsets as a list (the torch path) or with their device tensors, copied once
        # per forward and shared by the KDA layers (`ForwardBatch.varlen`).
        cu = batch.cu_seqlens if self.backend == "torch" else batch.varlen(qkv.device)
        params = (self.A_log, self.dt_bias)
        if cache is None:
            N, W = batch.num_seqs, conv_3CW.shape[-1]
            conv0 = qkv.new_zeros(N, 3 * H * K, W - 1)
            y, _ = ops.short_conv(qkv, conv_3CW, conv0, cu, backend=self.backend)
            q, k, v = y.view(T, 3, H, K).unbind(1)
            state0 = qkv.new_zeros(N, H, K, K, dtype=torch.float32)
            o, _ = ops.kda_core(q, k, v, f, b, *params, initial_state=state0, cu_seqlens=cu, **gate)
            return o
        warm = batch.positions  # nonzero: the sequence continues from its cached state
        pool = cache.kda_conv[self.layer_idx].flatten(1, 2)  # [NB, 3C, W-1]
        # Three contiguous [T, C] outputs, as the chunked kernels take q, k and v, with q and
        # k L2-normed per head.
        q, k, v = ops.short_conv_prefill_(
            qkv, conv_3CW, pool, batch.slots, warm, cu, num_parts=3, norm_parts=2, head_dim=K,
            backend=self.backend,
        ).view(3, T, H, K)
        state_pool = cache.kda_state[self.layer_idx]
        return ops.kda_prefill_(
            q, k, v, f, b, *params, state_pool=state_pool, slots=batch.slots, warm=warm,
            cu_seqlens=cu, **gate,
        )  # fmt: skip
