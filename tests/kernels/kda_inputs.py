"""Inputs shared by the KDA in-place kernel tests: strided views of an arena-like block buffer
(several layers per block) poisoned with 1e30 where no sequence lives, fresh (cold) blocks
holding NaN, and the CPU/GPU switch (without a GPU, tests/conftest.py has set TRITON_INTERPRET=1,
so the kernels run interpreted). Not a test module."""

import math

import torch

POISON = 1e30
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter rounds fp32 to bf16 toward zero (the GPU rounds to nearest): about half
# of a bf16 output lands one ulp low, ~4e-3 relative RMS, where the GPU flips an ulp rarely.
INTERPRETED_BF16_ROUNDING = 1e-2


def pools(NB, H, K, C, W, dtype, g, device=DEV):
    """(state [NB, H, K, K] fp32, conv [NB, 3, C, W-1]) views into one block buffer that also
    holds another layer's bytes, poisoned."""
    state_elems, conv_elems = H * K * K, 3 * C * (W - 1)
    state_buf = torch.full((NB, 2 * state_elems), POISON, device=device)
    conv_buf = torch.full((NB, 2 * conv_elems), POISON, dtype=dtype, device=device)
    state = state_buf[:, state_elems:].view(NB, H, K, K)
    conv = conv_buf[:, :conv_elems].view(NB, 3, C, W - 1)
    return state_buf, state, conv_buf, conv


def fill_blocks(view, slots, g):
    for s in slots:
        view[s] = torch.randn(view.shape[1:], generator=g).to(view.dtype)


def offsets(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def prefill_pools(NB, H, K, V, C, W, conv_dtype, warm, g, device, qkv=False):
    """Poisoned state and conv buffers with views as `pools`, K != V allowed; random distinct
    blocks for the sequences, holding a random state if warm, NaN if cold (stale bytes).
    Returns (state_buf, state_view_fn, conv_buf, conv_view_fn, slots, warm) where *_view_fn
    maps a buffer (or its clone) to the pool view the kernels take: the k conv's [NB, C, W-1],
    or with qkv the layer's three convs as one [NB, 3C, W-1] (as the model convolves them)."""
    hkv, cw = H * K * V, 3 * C * (W - 1)
    state_buf = torch.full((NB, 2 * hkv), POISON, device=device)
    conv_buf = torch.full((NB, 2 * cw), POISON, dtype=conv_dtype, device=device)

    def state_of(buf):
        return buf[:, hkv:].view(NB, H, K, V)

    def conv_of(buf):  # a strided view
        convs = buf[:, :cw].view(NB, 3, C, W - 1)
        return convs.flatten(1, 2) if qkv else convs[:, 1]

    slots = torch.randperm(NB, generator=g)[: len(warm)]
    for s, is_warm in zip(slots.tolist(), warm):
        state_of(state_buf)[s] = (torch.randn(H, K, V, generator=g) * 0.5) if is_warm else math.nan
        shape = conv_of(conv_buf).shape[1:]
        conv_of(conv_buf)[s] = torch.randn(shape, generator=g) if is_warm else math.nan
    warm_t = torch.tensor(warm, device=device)
    return state_buf, state_of, conv_buf, conv_of, slots.to(device), warm_t


def same_outside(buf, before, view_of, slots) -> bool:
    """The buffer equals `before` bit for bit (NaN included) outside view_of(buf)[slots]."""
    a, b = buf.clone(), before.clone()
    view_of(a)[slots] = 0
    view_of(b)[slots] = 0
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
