"""KDA ops with two backends: "torch" (fp32 reference, any device) and "fla" (fla-core Triton
kernels, CUDA). The model picks the backend once at construction; these functions only route.
The model runs each short conv over q, k and v at once (C = 3 H K channels, the three conv
weights and conv states concatenated), its input a strided column block of its fused projection.

Shapes as in `k3kernels.kda.reference`: packed T tokens, N sequences, H heads, K = V head dim.
"""

from k3kernels.kda import reference

BACKENDS = ("torch", "fla")


def _fla():
    from k3kernels.kda import fla  # imported lazily: needs CUDA and triton

    return fla


def kda_core(
    q,
    k,
    v,
    f,
    b,
    A_log,
    dt_bias,
    *,
    lower_bound,
    scale,
    initial_state,
    cu_seqlens,
    backend: str,
):
    """q, k: [T, H, K] after the conv; v: [T, H, V]; f: [T, H, K] raw decay logits; b: [T, H]
    raw beta logits; initial_state: [N, H, K, V] fp32; cu_seqlens: N+1 offsets (list).
    Returns (o [T, H, V], final state [N, H, K, V] fp32)."""
    kw = dict(
        lower_bound=lower_bound, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens
    )
    if backend == "fla":
        return _fla().kda_prefill(q, k, v, f, b, A_log, dt_bias, **kw)
    return reference.kda_core(q, k, v, f, b, A_log, dt_bias, chunked=True, **kw)


def short_conv(x, weight_CW, conv_state, cu_seqlens, *, backend: str):
    """x: [T, C]; weight [C, W]; conv_state [N, C, W-1] -> (y [T, C], new state [N, C, W-1])."""
    if backend == "fla":
        return _fla().short_conv(x, weight_CW, conv_state, cu_seqlens)
    return reference.short_conv(x, weight_CW, conv_state, cu_seqlens)


def kda_prefill_(
    q, k, v, f, b, A_log, dt_bias, *, lower_bound, scale, state_pool, slots, warm, cu_seqlens,
    backend: str,
):  # fmt: skip
    """`kda_core` in place on the cache: each sequence continues from state_pool[slots[n]]
    ([NB, H, K, V] fp32) where warm[n] != 0, from zeros elsewhere, and leaves its final state
    there. q, k: L2-normed already (`short_conv_prefill_`'s norm_parts); slots, warm: [N]
    device tensors; cu_seqlens: N+1 offsets (list). Returns o [T, H, V]."""
    kw = dict(lower_bound=lower_bound, scale=scale, state_pool=state_pool, slots=slots,
              warm=warm, cu_seqlens=cu_seqlens)  # fmt: skip
    impl = _fla() if backend == "fla" else reference
    return impl.kda_prefill_(q, k, v, f, b, A_log, dt_bias, **kw)


def short_conv_prefill_(x, weight_CW, pool_BCW, slots, warm, cu_seqlens, *, num_parts: int = 1,
                        norm_parts: int = 0, head_dim: int = 0, backend: str):  # fmt: skip
    """`short_conv` in place on the cache: x [T, C] (unit column stride); pool_BCW [NB, C, W-1]
    read (where warm) and overwritten at slots. Returns y [num_parts, T, C / num_parts]: channel
    c in part c // (C / num_parts), each part contiguous, the first norm_parts parts L2-normed
    over heads of head_dim channels (q and k as `kda_prefill_` takes them)."""
    impl = _fla() if backend == "fla" else reference
    return impl.short_conv_prefill_(x, weight_CW, pool_BCW, slots, warm, cu_seqlens, num_parts,
                                    norm_parts, head_dim)  # fmt: skip


def gated_rms_norm(o, z, weight, eps: float, *, backend: str):
    """RMSNorm(o) * sigmoid(z) over the last dim; o, z: [..., V]."""
    if backend == "fla":
        return _fla().gated_rms_norm(o, z, weight, eps)
    return reference.gated_rms_norm(o, z, weight, eps)


def warm_up(max_rows: int, dim: int, dtype, device, *, backend: str) -> None:
    """Tune ahead what the backend tunes by batch size, for up to max_rows rows (tokens x
    heads) of width dim: fla's gated norm (`tune_norm_buckets`); nothing for torch."""
    if backend == "fla":
        _fla().tune_norm_buckets(max_rows, dim, dtype, device)


def kda_decode_(q, k, v, f, b, A_log, dt_bias, *, lower_bound, scale, state_pool, slots, backend):
    """One step per sequence in place on the cache: state_pool [NB, H, K, V] fp32, slots [N]
    device indices. Returns o [N, H, V]."""
    kw = dict(lower_bound=lower_bound, scale=scale, state_pool=state_pool, slots=slots)
    impl = _fla() if backend == "fla" else reference
    return impl.kda_decode_(q, k, v, f, b, A_log, dt_bias, **kw)


def short_conv_decode_(x, weight_CW, pool_BCW, slots, *, backend: str):
    """x: [N, C], one token per sequence (unit column stride); pool_BCW: [NB, C, W-1] updated
    in place at slots. Returns y [N, C] (contiguous)."""
    impl = _fla() if backend == "fla" else reference
    return impl.short_conv_decode_(x, weight_CW, pool_BCW, slots)
