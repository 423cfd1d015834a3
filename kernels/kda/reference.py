"""Plain-torch fp32 reference of the KDA core: gate, L2 norm, recurrence (stepwise and chunked),
short convolution with a cached state, and the sigmoid-gated RMSNorm; the in-place decode and
prefill ops on a pool of cache blocks (gather, compute, scatter); and the inter-chunk state
recurrence alone (`chunk_state`, the oracle of the `chunk_state` kernel).

This is both the CPU backend of the engine and the oracle the Triton/fla path is tested against.
Shapes: T tokens of one sequence (or packed, with `cu_seqlens`), N sequences, H heads, K key
dim, V value dim, C conv channels, W conv kernel width. The recurrent state is K-first
[N, H, K, V], fp32. Conv states keep the last W-1 inputs, oldest first: [N, C, W-1].
"""

import torch
import torch.nn.functional as F


def kda_gate(f_THK, A_log_H, dt_bias, lower_bound: float | None):
    """Log-decay g in fp32, shape of f. K3: lower_bound * sigmoid(exp(A) * (f + dt_bias));
    Kimi Linear (lower_bound None): -exp(A) * softplus(f + dt_bias)."""
    H, K = f_THK.shape[-2:]
    x = f_THK.float() + dt_bias.float().view(H, K)
    a = A_log_H.float().view(H, 1).exp()
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def l2norm(x, eps: float = 1e-6):
    """x / sqrt(sum x^2 + eps) over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_recurrent(q, k, v, g, beta, scale: float, initial_state=None):
    """Step-by-step delta rule for one sequence.

    q, k: [T, H, K] (already L2-normalized); v: [T, H, V]; g: [T, H, K] log-decay; beta: [T, H]
    (after the sigmoid); initial_state: [H, K, V] fp32 or None. Returns (o [T, H, V] fp32,
    final state [H, K, V] fp32). Per step: S <- exp(g) S; u = beta (v - S^T k); S <- S + k u^T;
    o = scale * S^T q.
    """
    T, H, K = q.shape
    V = v.shape[-1]
    S = q.new_zeros(H, K, V, dtype=torch.float32)
    if initial_state is not None:
        S = S + initial_state.float()
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    o = q.new_empty(T, H, V, dtype=torch.float32)
    for t in range(T):
        S = S * g[t].exp()[..., None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], S))
        S = S + k[t][..., None] * u[:, None, :]
        o[t] = torch.einsum("hk,hkv->hv", q[t], S) * scale
    return o, S


def kda_chunked(q, k, v, g, beta, scale: float, initial_state=None, chunk_size: int = 64):
    """The same recurrence in chunks (WY / UT form), exact up to rounding; same args as
    `kda_recurrent`. Within a chunk with cumulative log-decay G_t, the corrections U solve
    (I + diag(beta) A) U = diag(beta) (V - (exp(G) * K) S0) with A[t, s] = sum_c k_t k_s
    exp(G_t - G_s) for s < t. Only differences G_t - G_s <= 0 are exponentiated."""
    T, H, K = q.shape
    V = v.shape[-1]
    S = q.new_zeros(H, K, V, dtype=torch.float32)
    if initial_state is not None:
        S = S + initial_state.float()
    q, k, v, g, beta = (t.float().transpose(0, 1) for t in (q, k, v, g, beta))  # head-major
    o = q.new_empty(H, T, V)
    for c0 in range(0, T, chunk_size):
        sl = slice(c0, min(c0 + chunk_size, T))
        qc, kc, vc, bc = q[:, sl], k[:, sl], v[:, sl], beta[:, sl]
        G = g[:, sl].cumsum(1)  # [H, C, K]
        C = G.shape[1]
        diff = G[:, :, None, :] - G[:, None, :, :]  # [H, t, s, K]
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(causal[None, :, :, None], diff, float("-inf")).exp()
        A_qk = torch.einsum("htk,hsk,htsk->hts", qc, kc, decay)  # s <= t
        A_kk = torch.einsum("htk,hsk,htsk->hts", kc, kc, decay).tril(-1)  # s < t
        eye = torch.eye(C, device=q.device)
        lhs = eye + bc[..., None] * A_kk
        rhs = bc[..., None] * (vc - (G.exp() * kc) @ S)
        U = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True)
        o[:, sl] = scale * ((G.exp() * qc) @ S + A_qk @ U)
        last = G[:, -1:, :]  # [H, 1, K]
        S = last.transpose(1, 2).exp() * S + ((last - G).exp() * kc).transpose(1, 2) @ U
    return o.transpose(0, 1), S


def kda_core(
    q, k, v, f, b, A_log, dt_bias, *, lower_bound, scale, initial_state, cu_seqlens, chunked: bool,
    qk_normed: bool = False,
):  # fmt: skip
    """The KDA core on a packed batch, from raw inputs (as fla's kernels take them with the
    gate, beta sigmoid and q/k L2 norm "in kernel").

    q, k: [T, H, K] after the short conv (and its L2 norm where qk_normed); v: [T, H, V];
    f: [T, H, K] raw decay logits; b: [T, H] raw beta logits; initial_state: [N, H, K, V]
    fp32; cu_seqlens: list of N+1 offsets.
    Returns (o [T, H, V] fp32, final states [N, H, K, V] fp32).
    """
    g = kda_gate(f, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(b.float())
    if not qk_normed:
        q, k = l2norm(q), l2norm(k)
    run = kda_chunked if chunked else kda_recurrent
    outs, states = [], []
    for n in range(len(cu_seqlens) - 1):
        sl = slice(cu_seqlens[n], cu_seqlens[n + 1])
        o, S = run(q[sl], k[sl], v[sl], g[sl], beta[sl], scale, initial_state[n])
        outs.append(o)
        states.append(S)
    return torch.cat(outs), torch.stack(states)


def short_conv(x, weight_CW, conv_state, cu_seqlens):
    """Causal depthwise conv + SiLU per sequence, continuing from a cached state.

    x: [T, C]; weight_CW: [C, W] (nn.Conv1d order: column W-1 multiplies the current token);
    conv_state: [N, C, W-1], the previous W-1 inputs, oldest first (zeros for a fresh sequence).
    Returns (y [T, C] in x's dtype, new conv_state [N, C, W-1] in x's dtype).
    """
    y, state = _conv_silu(x, weight_CW, conv_state, cu_seqlens)
    return y.to(x.dtype), state


def _conv_silu(x, weight_CW, conv_state, cu_seqlens):
    """`short_conv` with y in fp32 (not rounded)."""
    C, W = weight_CW.shape
    ys, states = [], []
    w = weight_CW.float()
    for n in range(len(cu_seqlens) - 1):
        xs = x[cu_seqlens[n] : cu_seqlens[n + 1]]
        full = torch.cat([conv_state[n].to(x.dtype), xs.t()], dim=1)  # [C, W-1+t]
        y = F.conv1d(full.float()[None], w[:, None, :], groups=C)[0]  # [C, t]
        ys.append(F.silu(y).t())
        states.append(full[:, full.shape[1] - (W - 1) :])
    return torch.cat(ys), torch.stack(states)


def gated_rms_norm(o, z, weight, eps: float):
    """RMSNorm over the last dim (weight shared by heads) times sigmoid(z); fp32 math.
    o, z: [..., V]; returns o's dtype."""
    x = o.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (x * torch.sigmoid(z.float())).to(o.dtype)


# ---- decode steps in place on the cache (the contract of the graph-capturable kernels) -------


def kda_decode_(q, k, v, f, b, A_log, dt_bias, *, lower_bound, scale, state_pool, slots):
    """One recurrent step for N sequences (one token each), reading and writing each one's
    state in place at `state_pool[slots[n]]`. state_pool: [NB, H, K, V] fp32 (a view into the
    arena); slots: [N] distinct indices. q, k, v, f, b as in `kda_core` with T == N.
    Returns o [N, H, V] fp32."""
    N = q.shape[0]
    o, state = kda_core(
        q,
        k,
        v,
        f,
        b,
        A_log,
        dt_bias,
        lower_bound=lower_bound,
        scale=scale,
        initial_state=state_pool[slots],
        cu_seqlens=list(range(N + 1)),
        chunked=False,
    )
    state_pool[slots] = state
    return o


def short_conv_decode_(x_NC, weight_CW, pool_BCW, slots):
    """One conv step for N sequences (one token each), in place on `pool_BCW[slots[n]]`
    ([NB, C, W-1], oldest input first). Returns y [N, C] in x's dtype."""
    N = x_NC.shape[0]
    y, state = short_conv(x_NC, weight_CW, pool_BCW[slots], list(range(N + 1)))
    pool_BCW[slots] = state.to(pool_BCW.dtype)
    return y


# ---- prefill in place on the cache (the contract of `chunk_state` and `conv_prefill`) --------


def _initial_states(pool, slots, warm):
    """pool[slots[n]] where warm[n] != 0, zeros elsewhere: a fresh sequence's block holds
    stale bytes (possibly NaN), so it is masked rather than multiplied by zero."""
    rows = pool[slots]
    keep = (warm != 0).view(-1, *[1] * (rows.dim() - 1))
    return torch.where(keep, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def kda_prefill_(
    q, k, v, f, b, A_log, dt_bias, *, lower_bound, scale, state_pool, slots, warm, cu_seqlens
):
    """`kda_core` (chunked) on a packed batch, each sequence continuing from its block's state
    `state_pool[slots[n]]` where warm[n] != 0 (zeros elsewhere) and leaving its final state
    there. q, k: L2-normed already (`short_conv_prefill_`'s norm_parts); state_pool:
    [NB, H, K, V] fp32; slots: [N] distinct indices; warm: [N] ints or bools; the rest as in
    `kda_core`. Returns o [T, H, V] fp32."""
    o, state = kda_core(
        q,
        k,
        v,
        f,
        b,
        A_log,
        dt_bias,
        lower_bound=lower_bound,
        scale=scale,
        initial_state=_initial_states(state_pool, slots, warm),
        cu_seqlens=cu_seqlens,
        chunked=True,
        qk_normed=True,
    )
    state_pool[slots] = state
    return o


def short_conv_prefill_(x, weight_CW, pool_BCW, slots, warm, cu_seqlens, num_parts: int = 1,
                        norm_parts: int = 0, head_dim: int = 0):  # fmt: skip
    """`short_conv` on a packed batch, in place on `pool_BCW[slots[n]]` ([NB, C, W-1], oldest
    input first; zeros stand in where warm[n] == 0). Returns y [num_parts, T, C / num_parts] in
    x's dtype, channel c in part c // (C / num_parts), each part contiguous (q, k and v of one
    conv over their concatenated channels); the first norm_parts parts L2-normed over each
    head's head_dim channels (q and k, as KDA takes them) before the one rounding."""
    y, state = _conv_silu(x, weight_CW, _initial_states(pool_BCW, slots, warm), cu_seqlens)
    pool_BCW[slots] = state.to(pool_BCW.dtype)
    y = y.unflatten(1, (num_parts, -1)).transpose(0, 1)
    if norm_parts:
        normed = l2norm(y[:norm_parts].unflatten(-1, (-1, head_dim))).flatten(-2)
        y = torch.cat([normed, y[norm_parts:]])
    return y.to(x.dtype).contiguous()


def chunk_state(kg, w, u, gk, initial_state, cu_seqlens, chunk_size: int = 64):
    """The inter-chunk recurrence of chunked KDA from the intra-chunk WY terms, in fp32 (the
    oracle of `k3kernels.kda.chunk_state`).

    kg, w, gk: [T, H, K] (gk the chunk-local cumulative log2 gate); u: [T, H, V];
    initial_state: [N, H, K, V]; cu_seqlens: N+1 offsets (list). Per chunk c of each sequence:
    h[c] = S; v_new_c = u_c - w_c S; S <- exp2(gk at c's last token) S + kg_c^T v_new_c.
    Returns (h [NT, H, K, V], v_new [T, H, V], final states [N, H, K, V]).
    """
    kg, w, u, gk = (t.float() for t in (kg, w, u, gk))
    v_new = torch.empty_like(u)
    hs, finals = [], []
    for n in range(len(cu_seqlens) - 1):
        S = initial_state[n].float()
        for c0 in range(cu_seqlens[n], cu_seqlens[n + 1], chunk_size):
            sl = slice(c0, min(c0 + chunk_size, cu_seqlens[n + 1]))
            hs.append(S)
            v_new[sl] = u[sl] - torch.einsum("thk,hkv->thv", w[sl], S)
            decay = gk[sl.stop - 1].exp2()[..., None]  # [H, K, 1]
            S = decay * S + torch.einsum("thk,thv->hkv", kg[sl], v_new[sl])
        finals.append(S)
    return torch.stack(hs), v_new, torch.stack(finals)


def chunk_state_(kg, w, u, gk, *, state_pool, slots, warm, cu_seqlens, chunk_size: int = 64):
    """`chunk_state` in place on the cache, as `kda_prefill_`. Returns (h, v_new) fp32."""
    init = _initial_states(state_pool, slots, warm)
    h, v_new, state = chunk_state(kg, w, u, gk, init, cu_seqlens, chunk_size)
    state_pool[slots] = state
    return h, v_new
