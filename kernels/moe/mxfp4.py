"""MXFP4 pack / unpack for the routed-expert weights of the K3 checkpoint (spec 11, 14.11), in
plain torch: the checkpoint writer and loader use it, and it is the reference of the W4A16
grouped GEMM (`k3kernels.moe.w4a16`).

Format assumed (our reading of compressed-tensors' `mxfp4-pack-quantized`: its
`pack_fp4_to_uint8` / `unpack_fp4_from_uint8`; not yet checked against the real K3 files):
- `weight_packed` uint8 [out, in/2]: byte j of a row holds input 2j in its LOW nibble and
  input 2j+1 in its HIGH nibble.
- each nibble is FP4 E2M1: bit 3 is the sign, bits 0..2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
- `weight_scale` uint8 [out, ceil(in/32)]: one E8M0 scale per 32 consecutive inputs of a row,
  value 2^(s - 127) (s = 255 is NaN and never written here). K3's widths are multiples of 32;
  the tiny flavors' are not (in = 24), so a last partial group is allowed (our extension).
So w[r, c] = fp4(nibble of packed[r, c // 2]) * 2^(scale[r, c // 32] - 127).

In memory (`MXFP4Weight`) the packed bytes take the W4A16 kernel's word layout instead
(`to_word_layout`, done once at load): each 32-bit word (4 bytes, little-endian: the inputs
8i..8i+7 of a row) holds the same 8 codes with their bits moved so that the kernel turns a word
into 4 registers of bf16 pairs in 8 integer instructions instead of 14 (`w4a16.py`). The
checkpoint's files keep the layout above; only the byte order within each word changes.
"""

from typing import NamedTuple

import torch

GROUP_SIZE = 32
E8M0_BIAS = 127
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes, indexed by bits 0..2
# Midpoints between neighbouring magnitudes; a tie rounds to the smaller magnitude.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


# Scale bytes up to this (scales up to 2) let the W4A16 kernel fold a constant into the scale
# (`w4a16._e2m1_pairs_bf16`): true of any trained weights (|w| < 12 per group).
MAX_SMALL_SCALE = 128


class MXFP4Weight(NamedTuple):
    """Stacked MXFP4 weights, one row per output: packed uint8 [E, N, K/2] in the kernel's word
    layout (`to_word_layout`) and scale uint8 [E, N, ceil(K/32)] as the checkpoint stores it;
    `shape` is the dequantized [E, N, K]. small_scales: every scale byte is <= MAX_SMALL_SCALE
    (`has_small_scales`, checked once when the weights are loaded); False is always correct,
    True lets the kernel take its fast path."""

    packed: torch.Tensor
    scale: torch.Tensor
    small_scales: bool = False

    @classmethod
    def from_checkpoint(cls, packed: torch.Tensor, scale: torch.Tensor) -> "MXFP4Weight":
        """From the checkpoint's layout (`quantize_mxfp4`'s output); reads the scales once."""
        return cls(to_word_layout(packed), scale, has_small_scales(scale))

    @property
    def shape(self) -> tuple[int, int, int]:
        E, N, half = self.packed.shape
        return E, N, 2 * half

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return dequantize_mxfp4(from_word_layout(self.packed), self.scale, dtype=dtype)


# The word layout. Code i of a word (input 8w + i; bits m, e0, e1, s = code bits 0..3) sits at
# these bit positions of the little-endian word. The kernel's registers: codes (0, 2) masked in
# place; (4, 6) and (1, 3) rotated right by 3 and 6, then masked; (5, 7) masked, placed by one
# multiply, masked (`w4a16._e2m1_words_bf16`). Each lands with m, e0, e1 at bits 6..8 and s at
# bit 15 of its half (low half: codes 0, 4, 1, 5): the bf16 pattern of code * 2^-126.
WORD_BITS = (
    (6, 7, 8, 15),  # code 0
    (12, 13, 14, 21),  # 1
    (22, 23, 24, 31),  # 2
    (28, 29, 30, 5),  # 3
    (9, 10, 11, 18),  # 4
    (3, 4, 0, 1),  # 5
    (25, 26, 27, 2),  # 6
    (19, 20, 16, 17),  # 7
)
_WORD_PERM = [WORD_BITS[i][b] for i in range(8) for b in range(4)]  # checkpoint bit 4i + b


def _byte_luts(dst: list[int]) -> torch.Tensor:
    """int64 [4, 256]: row j maps a value of byte j of a word to its bits moved to dst[p] (p =
    8 j + b, the source bit of the little-endian word)."""
    v = torch.arange(256, dtype=torch.int64)
    rows = [sum(((v >> b) & 1) << dst[8 * j + b] for b in range(8)) for j in range(4)]
    return torch.stack(rows)


_TO_WORD = _byte_luts(_WORD_PERM)  # checkpoint bit q -> word bit _WORD_PERM[q]
_FROM_WORD = _byte_luts([_WORD_PERM.index(p) for p in range(32)])


def _permute_words(packed: torch.Tensor, luts: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] with the bits of each 4-byte word moved by `luts` (`_byte_luts`): each
    byte looked up, the four lookups of a word summed (their bits do not overlap)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed FP4 data must be uint8, got {packed.dtype}")
    if packed.shape[-1] % 4:
        raise ValueError(f"the word layout needs inputs in multiples of 8, got "
                         f"{2 * packed.shape[-1]}")  # fmt: skip
    luts = luts.to(packed.device)
    byte = torch.arange(4, device=packed.device)
    moved = luts[byte, packed.unflatten(-1, (-1, 4)).long()].sum(-1, keepdim=True)
    return ((moved >> 8 * byte) & 0xFF).to(torch.uint8).flatten(-2)


def to_word_layout(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint bytes [..., K/2] -> the kernel's word layout (same shape, a new tensor)."""
    return _permute_words(packed, _TO_WORD)


def from_word_layout(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `to_word_layout`."""
    return _permute_words(packed, _FROM_WORD)


def has_small_scales(*scales: torch.Tensor) -> bool:
    """Whether every scale byte is <= MAX_SMALL_SCALE (a host sync: call it at load)."""
    return all(bool((s <= MAX_SMALL_SCALE).all()) for s in scales)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> 4-bit codes uint8 [..., 2n] (low nibble first)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed FP4 data must be uint8, got {packed.dtype}")
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [..., 2n] (values 0..15) -> uint8 [..., n]; inverse of `unpack_fp4`."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last dim, got shape {tuple(codes.shape)}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def fp4_to_float(codes: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes -> fp32 values (code 8 is -0.0)."""
    signed = _E2M1 + tuple(-v for v in _E2M1)
    table = torch.tensor(signed, dtype=torch.float32, device=codes.device)
    return table.take(codes.long())


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 exponents -> fp32 powers of two 2^(s - 127), built bit-exactly."""
    s = scale.to(torch.int32)
    # s >= 1: exponent field s, zero mantissa. s = 0: 2^-127 is the fp32 subnormal 1 << 22.
    bits = torch.where(s > 0, s << 23, torch.full_like(s, 1 << 22))
    bits = torch.where(s == 255, torch.full_like(s, 0x7FC00000), bits)  # NaN
    return bits.view(torch.float32)


# Lookups by byte: fp32 values [256, 2] of its two codes (low nibble first), its scale
_BYTE_VALUES = fp4_to_float(unpack_fp4(torch.arange(256, dtype=torch.uint8)[:, None]))
_SCALE_VALUES = e8m0_to_float(torch.arange(256, dtype=torch.uint8))  # 2^(s - 127) by byte


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32):
    """packed uint8 [..., in/2] + scale uint8 [..., ceil(in/32)] -> weight [..., in] in `dtype`
    (a checkpoint tensor is [out, in]; leading dims are batched).

    Exact: every FP4 value times a power of two is representable in fp32 and bf16.
    """
    in_size = 2 * packed.shape[-1]
    want = (*packed.shape[:-1], -(-in_size // GROUP_SIZE))
    if scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 scales must be uint8 (E8M0), got {scale.dtype}")
    if tuple(scale.shape) != want:
        raise ValueError(
            f"MXFP4 scale shape {list(scale.shape)} does not fit packed shape "
            f"{list(packed.shape)} (expected {list(want)})"
        )
    values = _pad_groups(_BYTE_VALUES.to(packed.device)[packed.long()].flatten(-2))
    w = values * _SCALE_VALUES.to(scale.device)[scale.long()][..., None]
    return w.flatten(-2)[..., :in_size].to(dtype)


def _pad_groups(x: torch.Tensor) -> torch.Tensor:
    """[..., in] -> [..., ceil(in/32), 32], zero-padding a partial last group."""
    pad = -x.shape[-1] % GROUP_SIZE
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.unflatten(-1, (-1, GROUP_SIZE))


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., in] (in even) -> (packed uint8 [..., in/2], scale uint8 [..., ceil(in/32)]).

    Per group of 32 inputs the shared exponent is floor(log2(amax)) - 2 (the OCP MX rule, also
    what compressed-tensors computes), so amax / 2^e lies in [4, 8) and rounds to 4 or 6; values
    round to the nearest E2M1 magnitude (ties to the smaller) and clip at 6. An all-zero group
    gets s = 0. Idempotent on its own output: quantize(dequantize(p, s)) == (p, s) for every
    (p, s) it produces, so a checkpoint can be rewritten without further loss.
    """
    in_size = w.shape[-1]
    if in_size % 2:
        raise ValueError(f"MXFP4 needs an even input size, got shape {list(w.shape)}")
    g = _pad_groups(w.detach().float())
    amax = g.abs().amax(dim=-1)
    _, exp = torch.frexp(amax)  # amax = m * 2^exp with m in [0.5, 1): floor(log2 amax) = exp - 1
    e = torch.where(amax > 0, exp - 3, torch.full_like(exp, -E8M0_BIAS))
    scale = (e.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)
    scaled = g / e8m0_to_float(scale)[..., None]  # exact: division by a power of two
    magnitude = scaled.abs()
    mag = torch.zeros(scaled.shape, dtype=torch.uint8, device=w.device)
    for bound in _E2M1_MIDPOINTS:  # count the midpoints below |x|; a tie stays below
        mag += magnitude > bound
    codes = mag | (torch.signbit(scaled).to(torch.uint8) << 3)
    return pack_fp4(codes.flatten(-2)[..., :in_size]), scale


def quantize_mxfp4_stacked(w_EOI: torch.Tensor, max_elems: int = 2**26):
    """`quantize_mxfp4` of stacked experts [E, out, in] on their device, a few experts at a
    time so that the fp32 temporaries stay near max_elems elements: (packed, scale) in the
    checkpoint's layout."""
    step = max(1, max_elems // w_EOI[0].numel())
    parts = [quantize_mxfp4(chunk) for chunk in w_EOI.detach().split(step)]
    return torch.cat([p for p, _ in parts]), torch.cat([s for _, s in parts])


@torch.no_grad()
def round_to_mxfp4_(w_EOI: torch.Tensor) -> MXFP4Weight:
    """Replace stacked experts [E, out, in] by their MXFP4-rounded values, in place, one expert
    at a time; returns the packed weights (dequantizing them gives `w_EOI` back exactly)."""
    packed, scale = quantize_mxfp4_stacked(w_EOI)
    for e in range(w_EOI.shape[0]):
        w_EOI[e].copy_(dequantize_mxfp4(packed[e], scale[e], dtype=w_EOI.dtype))
    return MXFP4Weight.from_checkpoint(packed, scale)
