"""Grouped GEMM over experts: rows [offs[e-1], offs[e]) of x times expert e's weight.

`torch._grouped_mm` (CUTLASS on Hopper for bf16; an ATen loop on CPU) takes the group ends on
the device, so nothing waits for the host. Its constraints (torch 2.11 to 2.13): operands of
one dtype, int32 `offs`, row strides a multiple of 16 bytes, 16-byte aligned data on CUDA; the
CUDA kernel is bf16 on sm90+ (other dtypes take a fallback that copies `offs` to the host).
Where those do not hold (fp32 on CUDA, old torch, odd widths), a plain loop over the groups
runs instead; it reads the group ends on the host (one sync).
Rows after offs[-1] are left unwritten (uninitialized): callers must not read them.
Batch invariance on CPU: a CPU GEMM of 1 to 3 rows takes another kernel (another summation
order) than a larger one, so a row's result would depend on how many rows share its expert in
the batch. On CPU every group is therefore padded to at least `CPU_MIN_ROWS` rows (zeros, on
the device, no host read) before `torch._grouped_mm`: a prompt scored alone, packed with others
or resumed after a prefix-cache hit gets the same expert outputs, bit for bit, which the eval's
exact scoring needs (`tests/kernels/test_moe.py` checks it).

Tile size: torch's CUTLASS dispatch picks 128 x 256 tiles when rows / groups > 128 and 64 x 128
tiles otherwise. K3-slice prefill has 16,384 slots over 112 experts, ~146 rows per group, so each
group fills one 128-row tile and 18/128 of a second: 57% of the computed rows are useful,
consistent with the H200's 378 TFLOP/s for the GEMMs alone (0.57 x ~660). Cutting the rows into
two or three calls, so that each has fewer rows per group and gets the 64 x 128 tiles (3 x 64 =
192 rows per ~146-row group: 76%), was measured slower on the H200: 30% of the peak against 47%
(`benchmarks/moe_k3slice_h200.jsonl`, rows "gemm-split2/3"). `grouped_gemm_triton` is the
way out on Hopper, the path the model takes there (tiles of 128 + 32 rows, the rows as the
MMA's N side: 54-57% of the peak on real activations, against 46-49% for this one).
Shape legend: M sorted rows, K input width, N output width, E experts.
"""

import torch

CPU_MIN_ROWS = 4  # CPU GEMMs of at least this many rows give each row the same bits


def grouped_mm(x_MK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """out[r] = x[r] @ w[e].T for the rows r of group e. x [M, K], w [E, N, K] (nn.Linear
    layout, any strides with a unit last stride), offs [E] int32 cumulative group ends.
    Returns [M, N] in x's dtype."""
    if not _has_fast_path(x_MK, w_ENK):
        return grouped_mm_loop(x_MK, w_ENK, offs_E)
    if x_MK.device.type == "cpu":
        x_PK, offs_E, pos_M = _pad_groups(x_MK, offs_E)
        return torch._grouped_mm(x_PK, w_ENK.transpose(-2, -1), offs=offs_E)[pos_M]
    return torch._grouped_mm(x_MK, w_ENK.transpose(-2, -1), offs=offs_E)


def _pad_groups(x_MK, offs_E):
    """x with every group padded to at least CPU_MIN_ROWS rows, the padded group ends and each
    row's position (P = M + CPU_MIN_ROWS * E rows). Rows after offs[-1] follow the last group."""
    offs = offs_E.long()
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    padded = counts.clamp(min=CPU_MIN_ROWS)
    padded_offs = torch.cumsum(padded, 0)
    rows = torch.arange(x_MK.shape[0], device=x_MK.device)
    group = torch.searchsorted(offs, rows, right=True).clamp(max=offs.shape[0] - 1)
    pos = rows + (padded_offs - padded - offs + counts)[group]
    x_PK = x_MK.new_zeros(x_MK.shape[0] + CPU_MIN_ROWS * offs.shape[0], x_MK.shape[1])
    x_PK[pos] = x_MK
    return x_PK, padded_offs.to(torch.int32), pos


def grouped_mm_loop(x_MK, w_ENK, offs_E):
    """The same product as a loop over groups (reads offs on the host)."""
    out = torch.empty(x_MK.shape[0], w_ENK.shape[1], dtype=x_MK.dtype, device=x_MK.device)
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        if end > start:
            torch.mm(x_MK[start:end], w_ENK[e].t(), out=out[start:end])
        start = end
    return out


def _has_fast_path(x_MK, w_ENK) -> bool:
    if not hasattr(torch, "_grouped_mm") or x_MK.dtype != w_ENK.dtype:
        return False
    align = 16 // x_MK.element_size()
    if x_MK.stride(-1) != 1 or w_ENK.stride(-1) != 1:
        return False
    if x_MK.stride(0) % align or w_ENK.stride(1) % align or w_ENK.stride(0) % align:
        return False
    if x_MK.device.type == "cpu":
        return True
    if x_MK.device.type != "cuda" or x_MK.dtype != torch.bfloat16:
        return False
    if x_MK.data_ptr() % 16 or w_ENK.data_ptr() % 16:
        return False
    return torch.cuda.get_device_capability(x_MK.device) >= (9, 0)
