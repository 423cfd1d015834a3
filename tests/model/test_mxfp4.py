"""MXFP4 (`k3kernels.moe.mxfp4`): a hand-made byte, pack/unpack, and quantize -> dequantize
exact on representable values and idempotent on its own output."""

import pytest
import torch
from k3kernels.moe.mxfp4 import (
    dequantize_mxfp4,
    fp4_to_float,
    pack_fp4,
    quantize_mxfp4,
    unpack_fp4,
)


def test_mxfp4_hand_made_byte():
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0xB2  # low nibble 0x2 = +1.0 (element 0), high nibble 0xB = -1.5 (element 1)
    w = dequantize_mxfp4(packed, torch.tensor([[128]], dtype=torch.uint8))  # scale 2^1
    assert w.shape == (1, 32)
    assert w[0, :2].tolist() == [2.0, -3.0] and not w[0, 2:].any()
    assert fp4_to_float(torch.arange(16, dtype=torch.uint8)).tolist() == [
        0.0,
        0.5,
        1.0,
        1.5,
        2.0,
        3.0,
        4.0,
        6.0,
        -0.0,
        -0.5,
        -1.0,
        -1.5,
        -2.0,
        -3.0,
        -4.0,
        -6.0,
    ]


def test_mxfp4_pack_unpack_roundtrip():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (5, 64), generator=gen, dtype=torch.uint8)
    assert torch.equal(unpack_fp4(pack_fp4(codes)), codes)
    # Exactly representable values survive quantize -> dequantize.
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    vals = mags[torch.randint(0, 8, (6, 64), generator=gen)] * torch.where(
        torch.rand(6, 64, generator=gen) < 0.5, -1.0, 1.0
    )
    vals[:, ::32] = 6.0  # every group reaches 6, so its exponent is 2^0
    vals = vals * 2.0 ** torch.randint(-20, 20, (6, 1), generator=gen)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(vals)), vals)


@pytest.mark.parametrize("in_size", [64, 24], ids=["in64", "in24-partial-group"])
def test_mxfp4_quantize_is_idempotent_on_packed_data(in_size):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 7, in_size, generator=gen) * 0.05
    w[0, 0] = 0.0  # an all-zero row: scale 0
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (3, 7, in_size // 2) and scale.shape == (3, 7, -(-in_size // 32))
    deq = dequantize_mxfp4(packed, scale)
    assert (deq - w).abs().max() <= w.abs().max() / 4  # a sanity bound, not a tolerance
    p2, s2 = quantize_mxfp4(deq)
    assert torch.equal(p2, packed) and torch.equal(s2, scale)
    assert torch.equal(dequantize_mxfp4(p2, s2, dtype=torch.bfloat16).float(), deq)
