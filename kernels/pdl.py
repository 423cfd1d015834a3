"""Programmatic dependent launch (PDL, sm_90+) for chains of small kernels.

A kernel launched with PDL may start while the kernel before it in the stream still runs: once
every program of that one has executed `griddepcontrol.launch_dependents` (or exited), the
next one's programs are scheduled on the SMs it frees; its `griddepcontrol.wait` then blocks
until that kernel has finished and its writes are visible. At a few tokens a kernel's launch
and ramp take as long as its work, and this hides them behind the previous kernel's tail.

The rule every kernel of a chain here follows: each of its programs, also one with nothing to
do, waits, then signals (`wait_then_signal`), before its first store and before it reads
anything the previous kernel writes. So when a kernel
starts, the kernel two before it has finished: before its own wait it may read that one's
outputs and constant data (the W4A16 decode kernel reads the slot sort's group ends and finds
its tile there). A kernel launched after a non-PDL one, or a non-PDL kernel after a chain, is
ordered as usual. Off under TRITON_INTERPRET=1 (the interpreter has no `griddepcontrol`) and
below sm_90.
The routed-expert pass at decode (slot sort, gather, W4A16 GEMM, activation, W4A16 GEMM,
combine) is such a chain. One H200, 7 k3-slice layers, MXFP4 experts, CUDA-graph replays, PDL
against the same kernels without it, one process (`benchmarks/kernels_h200.txt`, ninth
session; best of three rounds): 1 token 183 against 204 us, 4 tokens 393 against 429, 16 tokens
1,155 against 1,190, 64 tokens within the noise; with no GEMM tile to run (every slot another
rank's) 70 against 95 us, the chain's own cost. Prefetching the GEMM's first weight steps into
L2 before its wait made it slower (205 us at one token).
"""

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3kernels import INTERPRETED

ENABLED = not INTERPRETED  # the tests turn it off to compare


def launch_options(device: torch.device) -> dict:
    """The keyword arguments of a chain kernel's launch on device: its `PDL` constexpr, and
    Triton's `launch_pdl` where PDL applies."""
    if ENABLED and device.type == "cuda" and _sm90(device.index):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@functools.cache
def _sm90(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


@triton.jit
def wait_then_signal(PDL: tl.constexpr):
    """Wait for the previous kernel (its writes visible), then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
