"""Programmatic dependent launch (PDL, compute capability 9 and later), for chains of short
kernels whose fixed costs (launch, setup, the first loads, the tail) add up: at one decode token
each routed-expert GEMM of k3-slice moves ~12-23 MB in ~12 us, and torch's own `sum` over the
same buffers, one kernel each, goes no faster (`benchmarks/kernels_h200.txt`).

A kernel launched with `launch_pdl=True` may start once every program of the kernel before it
in the stream has called `griddepcontrol.launch_dependents` (or exited). Before it reads
anything that kernel wrote it must call `griddepcontrol.wait`, which returns when that kernel
has finished and its writes are visible. So what a kernel does before its wait overlaps the
kernel before it: finding its tile, computing addresses, and loads that depend on nothing
written since (weights, which `prefetch_l2` asks L2 for). The kernels here release their
dependents just before they wait (`release_and_wait`): the next kernel's programs then take
free SM slots, prefetch and wait there. A program that never waits must not read the previous
kernel's output; one that reads inputs before its wait relies on those coming from a kernel
that ended before the previous one began (a kernel launched without PDL in between).

Under CUDA graph capture the launches become programmatic edges of the graph. Not in the
interpreter (`pdl_ready`): there the constexpr `PDL` is false and the calls compile away.
"""

import os

import torch
import triton
import triton.language as tl

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read at import, like triton.jit


def pdl_ready(device: torch.device) -> bool:
    """Whether kernels can be launched with PDL on this device: compiled (not interpreted)
    for a CUDA GPU of compute capability 9 or more."""
    return (not _INTERPRETED and device.type == "cuda"
            and torch.cuda.get_device_capability(device) >= (9, 0))  # fmt: skip


def launch_options(pdl: bool, device: torch.device) -> dict:
    """The launch keywords of a kernel with a `PDL` constexpr: {"PDL": ...} and, when on,
    launch_pdl. pdl on a device that is not `pdl_ready` is an error."""
    if pdl and not pdl_ready(device):
        raise ValueError(f"programmatic dependent launch needs a compiled kernel on a CUDA GPU "
                         f"of compute capability 9 or more, not {device}"
                         f"{' (interpreter)' if _INTERPRETED else ''}")  # fmt: skip
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


@triton.jit
def release_and_wait(PDL: tl.constexpr):
    """With PDL: let the next kernel launch, then wait for the one before this to finish (every
    read of its output must come after this call)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the line holding each address (no registers filled, nothing waited for)."""
    tl.inline_asm_elementwise(
        asm="prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        constraints="=r,l",
        args=[ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
