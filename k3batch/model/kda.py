"""KDA layer (Kimi Delta Attention), K3 and Kimi Linear variants (spec section 4).

Projections, short convs and gates live here; the recurrence itself is `k3batch.ops.kda`.
Shape legend: T packed tokens, N sequences, D hidden, H heads, K = V head dim, C = H * K.
"""

import torch
from torch import nn

from k3batch.model.layers import RMSNorm, linear
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
        if config.kda_full_rank_gate:
            self.g_proj = linear(D, C, dtype, device)
        else:
            self.g_a_proj = linear(D, K, dtype, device)
            self.g_b_proj = linear(K, C, dtype, device)
        self.o_norm = RMSNorm(K, config.rms_norm_eps, dtype, device)  # weight shared by heads
        self.o_proj = linear(C, D, dtype, device)

    def forward(self, x_TD, batch, cache=None):
        T = x_TD.shape[0]
        H, K = self.num_heads, self.head_dim
        projs = (self.q_proj, self.k_proj, self.v_proj)
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        f = self.f_b_proj(self.f_a_proj(x_TD)).view(T, H, K)
        b = self.b_proj(x_TD).float()
        gate = dict(lower_bound=self.lower_bound, scale=K**-0.5, backend=self.backend)
        if batch.is_decode and cache is not None:
            # In place on the cache: each sequence's conv and recurrent state are read from and
            # written to its KDA block, with no gather and no new state tensor.
            slots = batch.slots
            pool = cache.kda_conv[self.layer_idx]
            q, k, v = (
                ops.short_conv_decode_(
                    proj(x_TD), conv.weight[:, 0], pool[:, j], slots, backend=self.backend
                ).view(T, H, K)
                for j, (proj, conv) in enumerate(zip(projs, convs))
            )
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
            o = self._prefill(x_TD, f, b, batch, cache, gate)
        if hasattr(self, "g_proj"):
            z = self.g_proj(x_TD)
        else:
            z = self.g_b_proj(self.g_a_proj(x_TD))
        y = ops.gated_rms_norm(
            o.to(x_TD.dtype),
            z.view(T, H, K),
            self.o_norm.weight,
            self.o_norm.eps,
            backend=self.backend,
        )
        return self.o_proj(y.reshape(T, H * K))

    def _prefill(self, x_TD, f, b, batch, cache, gate):
        """Chunks of whole sequences. With a cache, in place: each sequence continues from the
        conv and recurrent states in its KDA block if it has a cached prefix (from zeros
        otherwise: a fresh block holds stale bytes) and leaves its final states there. Without
        one (a one-shot forward), from zeros."""
        T = x_TD.shape[0]
        H, K = self.num_heads, self.head_dim
        # The offsets as a list (the torch path) or with their device tensors, copied once
        # per forward and shared by the KDA layers (`ForwardBatch.varlen`).
        cu = batch.cu_seqlens if self.backend == "torch" else batch.varlen(x_TD.device)
        projs = (self.q_proj, self.k_proj, self.v_proj)
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        params = (self.A_log, self.dt_bias)
        if cache is None:
            N, W = batch.num_seqs, self.q_conv1d.weight.shape[-1]
            conv0 = x_TD.new_zeros(N, H * K, W - 1)
            q, k, v = (
                ops.short_conv(proj(x_TD), conv.weight[:, 0], conv0, cu, backend=self.backend)[0]
                .view(T, H, K)
                for proj, conv in zip(projs, convs)
            )
            state0 = x_TD.new_zeros(N, H, K, K, dtype=torch.float32)
            o, _ = ops.kda_core(q, k, v, f, b, *params, initial_state=state0, cu_seqlens=cu, **gate)
            return o
        warm = batch.positions  # nonzero: the sequence continues from its cached state
        slots, pool = batch.slots, cache.kda_conv[self.layer_idx]
        q, k, v = (
            ops.short_conv_prefill_(
                proj(x_TD), conv.weight[:, 0], pool[:, j], slots, warm, cu, backend=self.backend
            ).view(T, H, K)
            for j, (proj, conv) in enumerate(zip(projs, convs))
        )
        state_pool = cache.kda_state[self.layer_idx]
        return ops.kda_prefill_(
            q, k, v, f, b, *params, state_pool=state_pool, slots=slots, warm=warm, cu_seqlens=cu,
            **gate,
        )  # fmt: skip
