"""MLA attention kernels: `reference` (plain torch, fp32, any device; the oracle), `decode`
(paged absorbed decode, split-K, returns the LSE), `merge` (LSE merge of partials: split-K
and DCP) and `prefill` (flash attention, expanded form, varlen, causal with a cached prefix).
The Triton modules import triton; this package and `reference` do not.

`TOLERANCES[(tensor_name, dtype)] = (rel_rms, max_abs or None)` bounds a kernel against the
fp32 reference fed the same (cast) inputs; rel_rms = rms(out - ref) / rms(ref). Names:
"decode_o" / "decode_lse", "merge_o" / "merge_lse", "prefill_o". With fp32 inputs the kernels
ask tl.dot for exact fp32 products (input_precision="ieee"), not TF32.
"""

import torch

_bf16, _fp32 = torch.bfloat16, torch.float32

TOLERANCES: dict[tuple[str, torch.dtype], tuple[float, float | None]] = {
    # p is rounded to bf16 before the p @ c product (~2e-3 relative per weight, averaging
    # down over the tokens) and the output is stored in bf16 (~1.6e-3 RMS): 2-3x margin.
    ("decode_o", _bf16): (1e-2, None),
    # Scores are fp32 sums of bf16 products, as in the reference: only the order differs.
    ("decode_lse", _bf16): (1e-4, None),
    ("decode_o", _fp32): (1e-5, None),
    ("decode_lse", _fp32): (1e-6, None),
    # fp32 weights and sums over fp32 partials: order only.
    ("merge_o", _fp32): (1e-6, None),
    ("merge_lse", _fp32): (1e-6, None),
    # As decode: p rounded to bf16 before p @ v, output rounded to bf16.
    ("prefill_o", _bf16): (1e-2, None),
    ("prefill_o", _fp32): (1e-5, None),
}
