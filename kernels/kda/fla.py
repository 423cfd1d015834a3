"""The KDA ops on fla-core 0.6.0's Triton kernels (CUDA only): a thin wrapper, same contracts
as `k3kernels.kda.reference`, inference only (autograd off inside).

- `kda_prefill`: `chunk_kda` on the packed batch (B = 1, `cu_seqlens`), safe_gate when the gate
  is bounded (K3).
  Gate, beta sigmoid and q/k L2 norm run in the kernel (spec 10.3); `lower_bound` alone picks
  the gate formula: -5.0 gives lower_bound * sigmoid(exp(A) (f + dt_bias)), None the softplus
  gate -exp(A) softplus(f + dt_bias) of Kimi Linear (fla's `kda_gate_chunk_cumsum` and the
  recurrent kernel both switch on it).
- `short_conv`: fla's `causal_conv1d` (varlen, prefill). fla's cache is [N, C, W] with column
  W-1 the newest input and column 0 never read; ours is [N, C, W-1], so it is padded with one
  zero column on the way in and trimmed on the way out (spec 14.5).
- `gated_rms_norm`: fla's fused `rms_norm_gated` with activation 'sigmoid'.
- `kda_decode_` / `short_conv_decode_`: the decode step in place on the cache, through block
  indices (our `recurrent_decode` and `conv_decode` kernels).
- `kda_prefill_` / `short_conv_prefill_`: prefill in place on the cache: `chunk_kda`'s steps
  with our `chunk_state` kernel for the state recurrence, and our `conv_prefill` kernel.

State layout: K-first [N, H, K, V] fp32 (fla's default, `state_v_first=False`).
Shape legend: T packed tokens, N sequences, H heads, K key dim, V value dim, C conv channels,
W conv width. fla is imported lazily so that this module imports on any machine.
"""

import torch
from k3kernels.kda.varlen import CHUNK_SIZE, as_varlen


def _cu_seqlens(cu_seqlens, device):
    """(device LongTensor, CPU LongTensor) of N+1 offsets (a list or a `Varlen`): the batch's
    own tensors when it is a `Varlen`, so that fla's identity-keyed caches (`tensor_cache`:
    `prepare_chunk_indices` copies its table with a blocking `.to()`) hit from the second layer
    of a forward on."""
    varlen = as_varlen(cu_seqlens, device)
    return varlen.cu, varlen.cu_cpu


def _gate_args(A_log, dt_bias, lower_bound):
    return {
        "A_log": A_log.float().contiguous(),
        "dt_bias": dt_bias.float().contiguous(),
        "lower_bound": lower_bound,
        "use_gate_in_kernel": True,
        "use_beta_sigmoid_in_kernel": True,
        "use_qk_l2norm_in_kernel": True,
    }


@torch.no_grad()
def kda_prefill(q, k, v, f, b, A_log, dt_bias, *, lower_bound, scale, initial_state, cu_seqlens):
    """KDA over a packed batch of whole chunks of sequences (`chunk_kda`).

    q, k: [T, H, K] after the conv, before the L2 norm; v: [T, H, V]; f: [T, H, K] raw decay
    logits; b: [T, H] raw beta logits; A_log [H] fp32; dt_bias [H*K] fp32; initial_state
    [N, H, K, V] fp32; cu_seqlens: N+1 offsets (a list, or a `Varlen`).
    Returns (o [T, H, V] in q's dtype, final state [N, H, K, V] fp32).
    """
    from fla.ops.kda import chunk_kda

    cu, cu_cpu = _cu_seqlens(cu_seqlens, q.device)
    o, state = chunk_kda(
        q[None],
        k[None],
        v[None],
        f[None],
        b[None],
        scale=scale,
        initial_state=initial_state.float().contiguous(),
        output_final_state=True,
        safe_gate=lower_bound is not None,  # the bounded gate's tensor-core path (spec 14.7)
        cu_seqlens=cu,
        cu_seqlens_cpu=cu_cpu,
        **_gate_args(A_log, dt_bias, lower_bound),
    )
    return o[0], state


@torch.no_grad()
def kda_prefill_(
    q, k, v, f, b, A_log, dt_bias, *, lower_bound, scale, state_pool, slots, warm, cu_seqlens
):
    """`kda_prefill` in place on the cache: each sequence continues from `state_pool[slots[n]]`
    where warm[n] != 0 (zeros elsewhere) and leaves its final state there. q and k come
    L2-normed (by the conv, `short_conv_prefill_`'s norm_parts).

    The steps of fla 0.6.0's `chunk_kda` forward (gate cumsum, intra-chunk WY terms, output)
    with our `chunk_state` kernel in place of `chunk_gated_delta_rule_fwd_h`, the one step that
    reads and writes the recurrent state: no [N, H, K, V] gather or scatter around the call.
    v, f, b, A_log, dt_bias as in `kda_prefill`; state_pool [NB, H, K, V] fp32 (each
    block's state contiguous); slots [N], warm [N]: device tensors; cu_seqlens: N+1 offsets
    (a list, or a `Varlen`: its device tables reused). Returns o [T, H, V] in q's dtype.
    """
    from fla.ops.common.gate import fused_beta_sigmoid_fwd
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
    from fla.ops.kda.gate import kda_gate_chunk_cumsum
    from fla.ops.utils.constant import RCP_LN2
    from k3kernels.kda.chunk_state import chunk_state_prefill_

    BT = CHUNK_SIZE  # chunk_kda's default chunk size
    # The chunk table on the device from the batch's one copy: fla's `prepare_chunk_indices`
    # would make it with a blocking copy (a wait for the GPU per layer).
    table = as_varlen(cu_seqlens, q.device)
    varlen = dict(cu_seqlens=table.cu, chunk_size=BT, chunk_indices=table.chunk_indices)
    q, k, v, f = (t.contiguous()[None] for t in (q, k, v, f))  # [1, T, H, *], as chunk_kda
    beta = fused_beta_sigmoid_fwd(b.contiguous()[None])
    g = kda_gate_chunk_cumsum(
        g=f,
        A_log=A_log.float().contiguous(),
        dt_bias=dt_bias.float().contiguous(),
        scale=RCP_LN2,  # log2 space: the kernels use exp2
        lower_bound=lower_bound,
        **varlen,
    )
    # chunk_kda_fwd passes safe_gate but not lower_bound to the intra-chunk step; so do we.
    w, u, _, kg, Aqk, _ = chunk_kda_fwd_intra(
        q=q, k=k, v=v, gk=g, beta=beta, scale=scale, safe_gate=lower_bound is not None, **varlen
    )
    h, v_new = chunk_state_prefill_(
        kg[0], w[0], u[0], g[0], state_pool=state_pool, slots=slots, warm=warm,
        cu_seqlens=table, chunk_size=BT,
    )  # fmt: skip
    o = chunk_gla_fwd_o_gk(q=q, v=v_new[None], g=g, A=Aqk, h=h[None], scale=scale, **varlen)
    return o[0]


def kda_decode_(q, k, v, f, b, A_log, dt_bias, *, lower_bound, scale, state_pool, slots):
    """One recurrent step per sequence in place on the cache: `k3kernels.kda.recurrent_decode`
    (fla's recurrent kernel takes V in blocks of 32 and reached ~63% of the copy bandwidth)."""
    from k3kernels.kda.recurrent_decode import kda_decode_

    return kda_decode_(q, k, v, f, b, A_log, dt_bias, lower_bound=lower_bound, scale=scale,
                       state_pool=state_pool, slots=slots)  # fmt: skip


def short_conv_decode_(x_NC, weight_CW, pool_BCW, slots):
    """One conv step per sequence in place on the cache: `k3kernels.kda.conv_decode`."""
    from k3kernels.kda.conv_decode import short_conv_decode_

    return short_conv_decode_(x_NC, weight_CW, pool_BCW, slots)


def short_conv_prefill_(x, weight_CW, pool_BCW, slots, warm, cu_seqlens, num_parts: int = 1,
                        norm_parts: int = 0, head_dim: int = 0):  # fmt: skip
    """`short_conv` in place on the cache: `k3kernels.kda.conv_prefill` (fla's causal_conv1d
    reads and writes states only through [N, C, W] tensors), launched as tuned for its shape
    (`launch_config`). Returns y [num_parts, T, C / num_parts], the first norm_parts parts
    L2-normed over heads of head_dim: in the conv's kernel where its channel blocks hold whole
    heads (a power of two up to the block: K3's and Kimi Linear's 128), else by fla's L2 norm
    after it."""
    from k3kernels.kda.conv_prefill import launch_config, short_conv_prefill_

    (T, C), W = x.shape, weight_CW.shape[1]
    launch = launch_config(T, C, W, num_parts, norm_parts)
    fused = head_dim > 0 and head_dim & (head_dim - 1) == 0 and launch["block_c"] % head_dim == 0
    y = short_conv_prefill_(x, weight_CW, pool_BCW, slots, warm, cu_seqlens,
                            num_parts=num_parts, norm_parts=norm_parts if fused else 0,
                            head_dim=head_dim if fused else 0, **launch)  # fmt: skip
    if norm_parts and not fused:
        from fla.modules.norm.l2norm import l2norm_fwd

        qk = y[:norm_parts]
        qk.copy_(l2norm_fwd(qk.reshape(-1, head_dim))[0].view_as(qk))
    return y


@torch.no_grad()
def short_conv(x, weight_CW, conv_state, cu_seqlens):
    """Causal depthwise conv + SiLU per sequence (prefill), continuing from a cached state.

    x: [T, C]; weight_CW: [C, W] (column W-1 multiplies the current token); conv_state
    [N, C, W-1], the previous W-1 inputs oldest first.
    Returns (y [T, C] in x's dtype, new conv_state [N, C, W-1] in x's dtype).
    """
    from fla.modules.causal_conv1d import causal_conv1d

    N, C = conv_state.shape[:2]
    weight = weight_CW.float().contiguous()
    # fla's [N, C, W] cache: column 0 is never read by the conv, so a zero column stands in.
    cache = torch.cat([conv_state.new_zeros(N, C, 1), conv_state], dim=-1).to(x.dtype).contiguous()
    cu, cu_cpu = _cu_seqlens(cu_seqlens, x.device)
    y, final = causal_conv1d(
        x.contiguous()[None],
        weight=weight,
        initial_state=cache,
        output_final_state=True,
        activation="silu",
        cu_seqlens=cu,
        cu_seqlens_cpu=cu_cpu,
    )
    return y[0], final[..., 1:].contiguous()


@torch.no_grad()
def gated_rms_norm(o, z, weight, eps: float):
    """RMSNorm(o) over the last dim (weight [V] shared by heads) times sigmoid(z), fp32 inside.
    o, z: [..., V]; returns o's dtype."""
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    return rms_norm_gated(o, z, weight, None, activation="sigmoid", eps=eps)


# fla's gated RMS norm keys its autotuning on the bucket NB = cdiv(rows, NORM_BUCKET_ROWS) of
# its rows (tokens x heads): a batch of a new bucket tunes it (tens of launch configs) before it
# runs. (So does its L2 norm, which the engine's prefill no longer runs: the conv norms q, k.)
NORM_BUCKET_ROWS = 2048 * 32


@torch.no_grad()
def tune_norm_buckets(max_rows: int, dim: int, dtype, device) -> None:
    """Run fla's gated norm once at each of its buckets up to max_rows rows of width dim, in
    dtype (autotuning is keyed on the argument dtypes too), so that later batches find it
    tuned: a job's steps under 8,192 tokens reach buckets (3 and 2 at 32 heads) that the
    warm-up's forwards (8,192 tokens and a few hundred) do not. (A cold one-H100 Kimi Linear
    job's one slow prefill step was first put down to this; with every bucket tuned at start-up
    the step remains: `docs/speed.md`.)"""
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    weight = torch.ones(dim, dtype=dtype, device=device)
    for nb in range(1, -(-max_rows // NORM_BUCKET_ROWS) + 1):
        x = torch.zeros(min(nb * NORM_BUCKET_ROWS, max_rows), dim, dtype=dtype, device=device)
        rms_norm_gated(x, x, weight, None, activation="sigmoid", eps=1e-6)
