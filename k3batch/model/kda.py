"""KDA layer (Kimi Delta Attention), K3 and Kimi Linear variants (spec section 4).

Projections, short convs and gates live here; the recurrence itself is `k3batch.ops.kda`.
Shape legend: T packed tokens, N sequences, D hidden, H heads, K = V head dim, C = H * K.
"""

import torch
from torch import nn

from k3batch.model.forward_batch import to_device
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
        """Chunks of whole sequences: states gathered from the blocks of sequences with a
        cached prefix (zeros otherwise), final states written back."""
        T = x_TD.shape[0]
        H, K = self.num_heads, self.head_dim
        cu = batch.cu_seqlens
        conv_in, state_in = self._read_cache(x_TD, batch, cache)
        projs = (self.q_proj, self.k_proj, self.v_proj)
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        outs, conv_out = [], []
        for j, (proj, conv) in enumerate(zip(projs, convs)):
            y, st = ops.short_conv(
                proj(x_TD), conv.weight[:, 0], conv_in[:, j], cu, backend=self.backend
            )
            outs.append(y.view(T, H, K))
            conv_out.append(st)
        q, k, v = outs
        o, state_out = ops.kda_core(
            q,
            k,
            v,
            f,
            b,
            self.A_log,
            self.dt_bias,
            initial_state=state_in,
            cu_seqlens=cu,
            **gate,
        )
        if cache is not None:
            slots = batch.slots
            cache.kda_state[self.layer_idx].index_copy_(0, slots, state_out)
            conv = torch.stack(conv_out, dim=1).to(cache.kda_conv[self.layer_idx].dtype)
            cache.kda_conv[self.layer_idx].index_copy_(0, slots, conv)
        return o

    def _read_cache(self, x_TD, batch, cache):
        """(conv states [N, 3, C, W-1], recurrent states [N, H, K, V]) to start from."""
        N, H, K = batch.num_seqs, self.num_heads, self.head_dim
        C, W = H * K, self.q_conv1d.weight.shape[-1]
        conv = x_TD.new_zeros(N, 3, C, W - 1)
        state = x_TD.new_zeros(N, H, K, K, dtype=torch.float32)
        if cache is None:
            return conv, state
        warm = [n for n, c in enumerate(batch.cached_lens) if c > 0]
        if warm:
            idx = to_device(warm, x_TD.device)
            slots = to_device([batch.slot_ids[n] for n in warm], x_TD.device)
            conv[idx] = cache.kda_conv[self.layer_idx][slots].to(conv.dtype)
            state[idx] = cache.kda_state[self.layer_idx][slots]
        return conv, state
