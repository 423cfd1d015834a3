"""Block Attention Residuals mixing (spec section 3): `reference` (plain torch, fp32 math, the
oracle) and `mix` (one Triton kernel: per token, the candidates' RMS and scores, the softmax over
candidates and the weighted sum, reading each candidate twice and writing the output once;
no stacked copy, no fp32 temporaries in memory). Runs under TRITON_INTERPRET=1 on CPU.

`TOLERANCES[(tensor_name, dtype)] = (rel_rms, max_abs or None)` bounds the kernel against the
fp32 reference on the same (cast) inputs; rel_rms = rms(out - ref) / rms(ref).
Importing this package imports neither triton nor any kernel.
"""

import torch

TOLERANCES: dict[tuple[str, torch.dtype], tuple[float, float | None]] = {
    # fp32 sums in another order, then one rounding to bf16 (~1.1e-3 rms; the CPU Triton
    # interpreter truncates instead of rounding: ~2.3e-3): 5e-3.
    ("mix", torch.bfloat16): (5e-3, None),
    # Summation order of the [D]-long RMS and score sums (D <= 7168): ~1e-7.
    ("mix", torch.float32): (1e-5, None),
}
MAX_CANDIDATES = 16  # the kernel's pointer slots; K3 (93 layers, blocks of 12) needs 10
