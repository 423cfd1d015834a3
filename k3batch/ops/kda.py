"""KDA ops with two backends: "torch" (fp32 reference, any device) and "fla" (fla-core Triton
kernels, CUDA). The model picks the backend once at construction; these functions only route.

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
    decode: bool,
    backend: str,
):
    """q, k: [T, H, K] after the conv; v: [T, H, V]; f: [T, H, K] raw decay logits; b: [T, H]
    raw beta logits; initial_state: [N, H, K, V] fp32; cu_seqlens: N+1 offsets (list).
    Returns (o [T, H, V], final state [N, H, K, V] fp32)."""
    kw = dict(
        lower_bound=lower_bound, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens
    )
    if backend == "fla":
        fn = _fla().kda_decode if decode else _fla().kda_prefill
        return fn(q, k, v, f, b, A_log, dt_bias, **kw)
    return reference.kda_core(q, k, v, f, b, A_log, dt_bias, chunked=not decode, **kw)


def short_conv(x, weight_CW, conv_state, cu_seqlens, *, decode: bool, backend: str):
    """x: [T, C]; weight [C, W]; conv_state [N, C, W-1] -> (y [T, C], new state [N, C, W-1])."""
    if backend == "fla":
        return _fla().short_conv(x, weight_CW, conv_state, cu_seqlens, decode=decode)
    return reference.short_conv(x, weight_CW, conv_state, cu_seqlens)


def gated_rms_norm(o, z, weight, eps: float, *, backend: str):
    """RMSNorm(o) * sigmoid(z) over the last dim; o, z: [..., V]."""
    if backend == "fla":
        return _fla().gated_rms_norm(o, z, weight, eps)
    return reference.gated_rms_norm(o, z, weight, eps)
