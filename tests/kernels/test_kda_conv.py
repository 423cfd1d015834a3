"""The KDA short convs in place on the cache (`conv_decode`, `conv_prefill`): each sequence's
conv state read from and written to its KDA block through block indices, against the
out-of-place reference; q, k and v as one launch over the fused projection's columns, q and k
L2-normed in the prefill kernel. Buffers as in `kda_inputs` (poisoned unused blocks that must
stay bit-identical, NaN in cold blocks); interpreted on CPU at tiny shapes, on CUDA at K3's and
Kimi Linear's widths (`gpu` marker).
"""

import pytest
import torch
from k3kernels.kda import TOLERANCES
from k3kernels.kda import reference as R
from kda_inputs import (
    DEV,
    INTERPRETED_BF16_ROUNDING,
    fill_blocks,
    offsets,
    pools,
    prefill_pools,
    same_outside,
)

from k3batch.testing import assert_close


@pytest.mark.parametrize(
    "N,C,block_c,w_dtype",
    [(1, 8, None, torch.float32), (5, 200, None, torch.float32), (5, 200, 64, torch.bfloat16)],
    ids=["N1-C8", "N5-C200", "N5-C200-blocks64-bf16w"],
)
def test_conv_decode_kernel_matches_reference(N, C, block_c, w_dtype):
    """Against the reference; with bf16 weights (read as they are: no fp32 copy per call) and
    several channel blocks per sequence (block_c) too."""
    from k3kernels.kda.conv_decode import short_conv_decode_

    g = torch.Generator().manual_seed(N + C)
    NB, W, dtype = N + 4, 4, torch.float32
    _, _, conv_buf, conv = pools(NB, 1, 1, C, W, dtype, g)
    slots = torch.randperm(NB, generator=g)[:N]
    fill_blocks(conv, slots.tolist(), g)
    before = conv_buf.clone()
    x = torch.randn(N, C, generator=g)
    w = (torch.randn(C, W, generator=g) * 0.5).to(w_dtype)
    ref_pool = conv[:, 1].cpu().clone()  # the reference runs on the CPU
    y_ref = R.short_conv_decode_(x, w, ref_pool, slots)
    y = short_conv_decode_(x.to(DEV), w.to(DEV), conv[:, 1], slots.to(DEV), block_c)
    assert_close("conv_y", y_ref, y.cpu(), rel_rms=TOLERANCES[("conv_y", dtype)][0])
    assert torch.equal(conv[:, 1].cpu(), ref_pool), "conv state must be an exact shift"
    touched = torch.zeros(NB, dtype=torch.bool)
    touched[slots] = True
    assert torch.equal(conv_buf[~touched].cpu(), before[~touched].cpu()), "other blocks written"
    rest = [0, 2]  # the other two convs (q and v) of the touched blocks are untouched too
    before_conv = before[:, : conv[0].numel()].view(conv.shape)
    assert torch.equal(conv[touched][:, rest].cpu(), before_conv[touched][:, rest].cpu())


@pytest.mark.parametrize(
    "block_c,dt", [(16, "fp32"), (128, "bf16")], ids=["BC16-tail-block-fp32", "BC128-bf16"]
)
def test_conv_decode_kernel_qkv_in_one_launch(block_c, dt):
    """The model's decode conv: q, k and v as one 3C-channel launch over the whole conv cache of
    a block ([3, C, W-1] flattened), its input a strided column block of the fused projection,
    equals three separate reference convs (each on its part of the cache)."""
    from k3kernels.kda.conv_decode import short_conv_decode_

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
    g = torch.Generator().manual_seed(7)
    N, C, W, NB = 3, 24, 4, 6
    _, _, conv_buf, conv = pools(NB, 1, 1, C, W, dtype, g)
    slots = torch.tensor([4, 0, 2])
    fill_blocks(conv, slots.tolist(), g)
    before = conv_buf.clone()
    proj = torch.randn(N, 3 * C + 5, generator=g).to(dtype)  # q | k | v | other projections
    w = torch.randn(3, C, W, generator=g) * 0.5
    ref_pools = conv.cpu().clone()
    parts = [proj[:, j * C : (j + 1) * C] for j in range(3)]
    y_ref = torch.cat([R.short_conv_decode_(parts[j], w[j], ref_pools[:, j], slots)
                       for j in range(3)], dim=1)  # fmt: skip
    x = proj.to(DEV)[:, : 3 * C]
    y = short_conv_decode_(x, w.flatten(0, 1).to(DEV), conv.flatten(1, 2), slots.to(DEV), block_c)
    rel_rms = TOLERANCES[("conv_y", dtype)][0]
    if DEV == "cpu" and dtype == torch.bfloat16:  # interpreted (tests/conftest.py)
        rel_rms = INTERPRETED_BF16_ROUNDING
    assert_close("conv_y", y_ref, y.cpu(), rel_rms=rel_rms)
    assert torch.equal(conv[slots].cpu(), ref_pools[slots]), "conv states must be exact shifts"
    others = [i for i in range(NB) if i not in slots.tolist()]
    assert torch.equal(conv_buf[others].cpu(), before[others].cpu()), "other blocks written"
    layer = conv[0].numel()  # the other layer's bytes of the touched blocks
    assert torch.equal(conv_buf[:, layer:].cpu(), before[:, layer:].cpu())


def _conv_case(lens, warm, C, dtype, block_t, block_c, device, W=4, **parts):
    """The conv_prefill kernel against `reference.short_conv_prefill_` (on the CPU: cuDNN's
    fp32 conv may use TF32): y within tolerance, the conv state exact, every other byte of the
    buffer untouched. parts: num_parts, norm_parts, head_dim of both."""
    from k3kernels.kda.conv_prefill import short_conv_prefill_

    g = torch.Generator().manual_seed(sum(lens) + C)
    NB = len(lens) + 3
    _, _, buf, conv_of, slots, warm = prefill_pools(NB, 1, 1, 1, C, W, dtype, warm, g, device)
    x = torch.randn(sum(lens), C, generator=g).to(dtype)
    w = torch.randn(C, W, generator=g) * 0.5
    ref_buf, before, cu = buf.to("cpu", copy=True), buf.clone(), offsets(lens)
    y_ref = R.short_conv_prefill_(x, w, conv_of(ref_buf), slots.cpu(), warm.cpu(), cu, **parts)
    y = short_conv_prefill_(x.to(device), w.to(device), conv_of(buf), slots, warm, cu,
                            block_t=block_t, block_c=block_c, **parts)  # fmt: skip
    assert y.dtype == dtype
    rel_rms = TOLERANCES[("conv_y", dtype)][0]
    if device == "cpu" and dtype == torch.bfloat16:  # interpreted (tests/conftest.py)
        rel_rms = INTERPRETED_BF16_ROUNDING
    assert_close("conv_y", y_ref, y, rel_rms=rel_rms)
    state_ref, state = conv_of(ref_buf)[slots.cpu()], conv_of(buf)[slots]
    assert torch.equal(state.cpu(), state_ref), "conv state must be an exact copy of inputs"
    assert same_outside(buf, before, conv_of, slots), "bytes outside the batch's states written"


@pytest.mark.parametrize("block_c", [8, 16], ids=["BC8-blocks-in-parts", "BC16-blocks-straddle"])
def test_conv_prefill_kernel_qkv_in_one_launch(block_c):
    """The model's prefill conv: q, k and v as one 3C-channel launch over the layer's whole conv
    cache ([NB, 3, C, W-1] flattened), its input a strided column block of the fused projection,
    its output three contiguous [T, C] parts; equal to three separate reference convs, each on
    its own part of the cache. C = 24: 16-channel blocks straddle the parts."""
    from k3kernels.kda.conv_prefill import short_conv_prefill_

    g = torch.Generator().manual_seed(11)
    lens, warm, C, W = [1, 2, 9, 20], [1, 0, 1, 0], 24, 4
    _, _, buf, conv_of, slots, warm = prefill_pools(len(lens) + 2, 1, 1, 1, C, W, torch.float32,
                                                     warm, g, DEV, qkv=True)  # fmt: skip
    proj = torch.randn(sum(lens), 3 * C + 5, generator=g)  # q | k | v | other projections
    w = torch.randn(3 * C, W, generator=g) * 0.5
    ref_buf, before, cu = buf.to("cpu", copy=True), buf.clone(), offsets(lens)
    start = buf.to("cpu", copy=True)  # (the reference writes the states of a CPU `before`)
    ref_parts = ref_buf[:, : 3 * C * (W - 1)].view(-1, 3, C, W - 1)
    y_ref = [R.short_conv_prefill_(proj[:, j * C : (j + 1) * C], w[j * C : (j + 1) * C],
                                   ref_parts[:, j], slots.cpu(), warm.cpu(), cu)[0]
             for j in range(3)]  # fmt: skip
    y = short_conv_prefill_(proj.to(DEV)[:, : 3 * C], w.to(DEV), conv_of(buf), slots, warm, cu,
                            num_parts=3, block_t=8, block_c=block_c)  # fmt: skip
    assert y.shape == (3, sum(lens), C) and y.is_contiguous()
    rel_rms = TOLERANCES[("conv_y", torch.float32)][0]
    for j in range(3):
        assert_close("conv_y", y_ref[j], y[j].cpu(), rel_rms=rel_rms)
    assert torch.equal(conv_of(buf)[slots].cpu(), conv_of(ref_buf)[slots.cpu()])
    assert same_outside(buf, before, conv_of, slots), "bytes outside the batch's states written"
    # The reference's parts are those of one conv over the 3C channels.
    ref = R.short_conv_prefill_(proj[:, : 3 * C], w, conv_of(before.cpu()), slots.cpu(),
                                warm.cpu(), cu, num_parts=3)  # fmt: skip
    assert torch.equal(ref, torch.stack(y_ref))
    # As the model runs it: q and k (the first two parts) L2-normed over heads of 8 channels
    # (the reference: the same conv, each head's norm; v as before), the state as before.
    ref_normed = R.short_conv_prefill_(proj[:, : 3 * C], w, conv_of(start.clone()), slots.cpu(),
                                       warm.cpu(), cu, num_parts=3, norm_parts=2, head_dim=8)
    buf.copy_(start)
    y = short_conv_prefill_(proj.to(DEV)[:, : 3 * C], w.to(DEV), conv_of(buf), slots, warm, cu,
                            num_parts=3, norm_parts=2, head_dim=8, block_t=8,
                            block_c=block_c)  # fmt: skip
    heads = ref_normed[:2].unflatten(-1, (-1, 8))
    assert torch.allclose(heads.norm(dim=-1), torch.ones(()), atol=1e-5)
    assert torch.equal(ref_normed[2], ref[2])
    assert_close("conv_y_normed", ref_normed, y.cpu(), rel_rms=rel_rms)
    assert torch.equal(conv_of(buf)[slots].cpu(), conv_of(ref_buf)[slots.cpu()])
    with pytest.raises(ValueError, match="L2 norm"):  # a head across two blocks
        short_conv_prefill_(proj.to(DEV)[:, : 3 * C], w.to(DEV), conv_of(buf), slots, warm, cu,
                            num_parts=3, norm_parts=2, head_dim=8 * block_c // 4,
                            block_c=block_c)  # fmt: skip


@pytest.mark.parametrize("dt", ["fp32", "bf16"])
def test_conv_prefill_kernel_in_place_matches_reference(dt):
    """Sequences of 1 and 2 tokens (< W-1: the old state shifts), warm and cold, one over
    several token blocks; C=40 over three channel blocks."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
    _conv_case([1, 2, 2, 7, 21], [1, 1, 0, 0, 1], 40, dtype, 8, 16, DEV)


@pytest.mark.parametrize("W", [2, 3])
def test_conv_prefill_kernel_narrower_windows(W):
    """Widths under 4 (the kernel's window holds up to 3 rows; its oldest taps are zeros), warm
    and cold sequences shorter than the window; a width over 4 is refused."""
    from k3kernels.kda.conv_prefill import short_conv_prefill_

    _conv_case([1, 2, 11], [1, 0, 1], 16, torch.float32, 8, 16, DEV, W=W)
    x, pool = torch.zeros(4, 8, device=DEV), torch.zeros(2, 8, 4, device=DEV)
    with pytest.raises(ValueError, match="conv width 5"):
        short_conv_prefill_(x, torch.zeros(8, 5, device=DEV), pool, torch.tensor([0], device=DEV),
                            torch.tensor([0], device=DEV), [0, 4])  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dt", ["bf16", "fp32"])
@pytest.mark.parametrize("qk", ["plain", "qk-normed"])
def test_conv_prefill_kernel_in_place_matches_reference_gpu(dt, qk):
    """K3 width (96 heads of 128; qk-normed: as Kimi Linear's model runs it, q | k | v of 32
    heads each, q and k L2-normed per head), default blocks."""
    from k3kernels.kda.conv_prefill import BLOCK_C, BLOCK_T

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
    parts = dict(num_parts=3, norm_parts=2, head_dim=128) if qk == "qk-normed" else {}
    _conv_case([1000, 64, 37, 2, 1], [1, 0, 1, 1, 0], 96 * 128, dtype, BLOCK_T, BLOCK_C, "cuda",
               **parts)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("head_dim", [128, 96], ids=["heads-in-blocks", "heads-by-fla-norm"])
def test_fla_conv_prefill_norms_q_and_k_at_any_head_dim_gpu(head_dim):
    """The model's conv through the fla backend: q and k L2-normed in the conv's kernel where
    its channel blocks hold whole heads (128), by fla's L2 norm after it elsewhere (96), both
    against the reference (fp32)."""
    from k3kernels.kda import fla

    g = torch.Generator().manual_seed(head_dim)
    lens, warm, C, W = [300, 37, 1], [1, 0, 1], 4 * head_dim, 4
    _, _, buf, conv_of, slots, warm = prefill_pools(len(lens) + 2, 1, 1, 1, C, W, torch.float32,
                                                     warm, g, "cuda", qkv=True)  # fmt: skip
    x, w = torch.randn(sum(lens), 3 * C, generator=g), torch.randn(3 * C, W, generator=g) * 0.5
    ref_buf, cu = buf.to("cpu", copy=True), offsets(lens)
    ref = R.short_conv_prefill_(x, w, conv_of(ref_buf), slots.cpu(), warm.cpu(), cu, 3, 2,
                                head_dim)  # fmt: skip
    y = fla.short_conv_prefill_(x.cuda(), w.cuda(), conv_of(buf), slots, warm, cu, 3, 2, head_dim)
    assert_close("conv_y_normed", ref, y.cpu(), rel_rms=TOLERANCES[("conv_y", torch.float32)][0])
    assert torch.equal(conv_of(buf)[slots].cpu(), conv_of(ref_buf)[slots.cpu()])
