"""Routed-expert (MoE) kernels: token slots sorted by expert, grouped GEMMs, a fused gated
activation and a deterministic fp32 combine. No host syncs on the device path.

- `reference.py`: the fp32 torch oracle (one plain loop over experts), any device.
- `route.py`: the router's top-k (one Triton kernel) and the slot sort (one launch at decode
  sizes, two above).
- `permute.py`: `sort_slots` (order of the token slots by expert, group offsets, each slot's
  position in that order), all on the device.
- `grouped_gemm.py`: `grouped_mm` (`torch._grouped_mm` where it runs, a loop elsewhere).
- `act.py`: `moe_act` (SiTU / SwiGLU of the fused gate-up rows, one Triton kernel).
- `combine.py`: `moe_combine` (weighted sum of each token's top-k rows in fp32, one Triton
  kernel, fixed summation order: deterministic for a given batch).
- `experts.py`: `fused_experts`, the whole routed-expert pass built from the above.

`TOLERANCES[(tensor_name, dtype)] = (rel_rms, max_abs or None)` bounds each path against the fp32
reference fed the same (cast) inputs; rel_rms = rms(out - ref) / rms(ref). Names: "act" (fused
activation), "combine" (weighted top-k sum), "experts" (the whole pass, fp32 [T, Din]).
Importing this package imports neither triton nor any kernel.
"""

import torch

_bf16, _fp32 = torch.bfloat16, torch.float32

TOLERANCES: dict[tuple[str, torch.dtype], tuple[float, float | None]] = {
    # fp32 math on the same inputs, then one rounding to bf16 (rms 2^-9 / sqrt(3) ~ 1.1e-3 of
    # each value; the CPU Triton interpreter truncates instead: ~2.3e-3); 5e-3 allows that plus
    # tanh built from exp (abs error ~1e-7).
    ("act", _bf16): (5e-3, None),
    # tanh and sigmoid from exp2 and one reciprocal (MUFU approximations on a GPU, within 2 ulp)
    # against torch.tanh and torch.sigmoid: ~1e-7 absolute on O(1) outputs.
    ("act", _fp32): (1e-5, None),
    # Products and a k-term sum in fp32 from the same values: summation order only.
    ("combine", _bf16): (1e-6, None),
    ("combine", _fp32): (1e-6, None),
    # bf16 rounds three tensors the reference keeps in fp32 (gate-up GEMM output, activation,
    # down GEMM output), each ~1.1e-3 rms, plus bf16 GEMM accumulation order: ~2.5e-3
    # expected; 1e-2 leaves a 4x margin without hiding a wrong expert (that gives ~1.0).
    ("experts", _bf16): (1e-2, None),
    # fp32: accumulation order of the GEMMs (K = 3584) and the exp-based tanh.
    ("experts", _fp32): (1e-5, None),
}
