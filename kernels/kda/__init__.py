"""KDA (Kimi Delta Attention) kernels: `reference` (plain torch, fp32 math, any device; the
oracle) and `fla` (fla-core 0.6.0 Triton kernels, CUDA only, imported lazily by callers).

`TOLERANCES[(tensor_name, dtype)] = (rel_rms, max_abs or None)` bounds the fla path against the
fp32 reference, both fed the same inputs (drawn in fp32, cast to `dtype`, the reference reading
the cast values). rel_rms = rms(out - ref) / rms(ref). Names: "o" / "state" (prefill output and
final state), "o_decode" / "state_decode", "conv_y" / "conv_state", "norm_y", and for the
`chunk_state` kernel alone (fed WY terms, against `reference.chunk_state`) "chunk_h" /
"chunk_v_new" / "chunk_state".
Importing this package imports neither fla nor triton.
"""

import torch

_bf16, _fp32 = torch.bfloat16, torch.float32

TOLERANCES: dict[tuple[str, torch.dtype], tuple[float, float | None]] = {
    # chunk_kda keeps the L2-normed q/k, the per-chunk states h and the WY terms (u, w, v_new)
    # in bf16; a simulation of those roundings gives ~4e-3 (o) and ~3e-3 (state): 2.5x margin.
    ("o", _bf16): (1e-2, None),
    ("state", _bf16): (1e-2, None),
    # fp32 inputs: Triton's tl.dot runs fp32 operands as TF32 (10-bit mantissa, ~5e-4 per
    # product) through ~4 chained matmuls.
    ("o", _fp32): (5e-3, None),
    ("state", _fp32): (5e-3, None),
    # fused_recurrent_kda computes in fp32 registers; o is stored in v's dtype, so bf16's
    # output rounding (~1.6e-3 relative RMS) is the floor.
    ("o_decode", _bf16): (5e-3, None),
    ("o_decode", _fp32): (1e-5, None),
    # The decode state is fp32 math on the same rounded inputs as the reference.
    ("state_decode", _bf16): (1e-5, None),
    ("state_decode", _fp32): (1e-5, None),
    # Four fp32 products summed, SiLU, one rounding to the output dtype: the only difference
    # from the reference is summation order, so rare one-ulp flips in bf16 (measured on an
    # H200: 1.2e-5); 1e-3 still allows a one-ulp flip on ~6% of the elements.
    ("conv_y", _bf16): (1e-3, None),
    ("conv_y", _fp32): (1e-5, None),
    # The conv state is a copy of inputs: exact (tests use torch.equal).
    ("conv_state", _bf16): (0.0, 0.0),
    ("conv_state", _fp32): (0.0, 0.0),
    # chunk_state rounds as fla's kernel does: S enters w @ S in bf16, v_new is stored and
    # multiplied in bf16, h is stored in bf16. A torch simulation of those roundings at H=2,
    # K=V=128, sequences of 1000, 64 and 37 tokens (WY terms of the K3 gate) gives 1.8e-3 (h),
    # 1.5e-3 (v_new), 1.3e-3 (state); the kernel under Triton's interpreter, which rounds to
    # bf16 toward zero, 4.2e-3, 3.3e-3, 2.8e-3, still 2.4x inside.
    ("chunk_h", _bf16): (1e-2, None),
    ("chunk_v_new", _bf16): (1e-2, None),
    ("chunk_state", _bf16): (1e-2, None),
    # fp32 operands run as TF32 on the GPU: a simulation (operands rounded to 10 mantissa
    # bits) at the shapes above gives 1.5e-4 (h), 1.8e-5 (v_new), 2.9e-4 (state).
    ("chunk_h", _fp32): (2e-3, None),
    ("chunk_v_new", _fp32): (2e-3, None),
    ("chunk_state", _fp32): (2e-3, None),
    # fp32 RMSNorm and sigmoid, one rounding to o's dtype: rare one-ulp flips (1.5e-5 measured).
    ("norm_y", _bf16): (1e-3, None),
    ("norm_y", _fp32): (1e-5, None),
}
