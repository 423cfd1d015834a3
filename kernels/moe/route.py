"""Routing and the slot sort of a decode step as two Triton kernels.

At decode the router's elementwise steps (sigmoid, bias, top-k, gather, renormalize, scale) and
`sort_slots`' radix sort and binary searches are a dozen kernels per MoE layer on a few hundred
values: launches, not bytes. Here they are two.

`route_kernel`, one program per token: sigmoid of the fp32 router logits, top-k of score + bias
by k rounds of argmax (the lowest index wins a tie), weights from the unbiased scores,
renormalized and scaled. Oracle: `reference.route_reference`.

`sort_slots_kernel`: the stable order of the M = T k slots by local expert, computed by
counting. Slot i's row is #{j: key_j < key_i} + #{j < i: key_j = key_i}; expert e's group ends
at #{j: key_j <= e}. Every program reads all M keys and writes its own BLOCK slots' rows and
BLOCK experts' ends: no atomics, the same result whatever the schedule. The work is M^2, so
`sort_slots` uses it only up to `MAX_SLOTS` (decode). Above, two launches over blocks of
`SORT_BLOCK` slots: `block_counts_kernel` counts each block's keys; `block_rows_kernel` gives
each block its keys' first rows (the groups' starts plus the counts of the blocks before it) and
its slots their rows in a stable sort of (key, slot) within the block (torch's radix sort,
binary search and scatter were ~10 launches and ~0.1 ms a layer at 8,192 tokens on an H200).
Oracle of both: `permute.sort_slots`.
Shape legend: T tokens, E experts (local E for the sort), k top-k, M = T k slots.
"""

import torch
import triton
import triton.language as tl

from k3kernels.moe.permute import SlotOrder
from k3kernels.pdl import launch_options, wait_then_signal

MAX_SLOTS = 1024  # the counting sort's M^2 work stays under ~1 M compares
SORT_BLOCK = 2048  # slots per program of the blocked sort above MAX_SLOTS
ONE_WARP_TOKENS = 512  # `route` runs one warp a token above this many tokens (decode: four)


@triton.jit
def route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, E, scaling,
                 TOP_K: tl.constexpr, KP2: tl.constexpr, RENORM: tl.constexpr,
                 BLOCK_E: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    wait_then_signal(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    emask = e < E
    x = tl.load(logits_ptr + t * E + e, mask=emask, other=0.0)
    scores = 1.0 / (1.0 + tl.exp(-x))
    biased = tl.where(emask, scores + tl.load(bias_ptr + e, mask=emask, other=0.0), float("-inf"))
    lanes = tl.arange(0, KP2)  # k lanes used, padded to a power of two
    ids = tl.zeros([KP2], dtype=tl.int64)
    w = tl.zeros([KP2], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(biased, axis=0)
        ids = tl.where(lanes == j, best, ids)
        w = tl.where(lanes == j, tl.sum(tl.where(e == best, scores, 0.0), axis=0), w)
        biased = tl.where(e == best, float("-inf"), biased)
    if RENORM:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    tl.store(ids_ptr + t * TOP_K + lanes, ids, mask=lanes < TOP_K)
    tl.store(w_ptr + t * TOP_K + lanes, w * scaling, mask=lanes < TOP_K)


def route(logits_TE, bias_E, top_k: int, renormalize: bool, scaling: float):
    """(ids [T, k] int64, weights [T, k] fp32) from fp32 logits [T, E] and bias [E]."""
    T, E = logits_TE.shape
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits_TE.device)
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits_TE.device)
    if T:
        # Prefill: one warp a token up to 1,024 experts (32 scores a thread), so its 2k
        # reductions are warp shuffles with no exchange through shared memory and no barrier
        # (compiled for sm_90 at 256 experts, top-8: 1,240 warp instructions a token against
        # 4 x 792 and 39 barriers). Decode batches keep four warps: there a program's latency,
        # not the instructions issued, makes the kernel's time (one wave), untimed so far.
        BLOCK_E = triton.next_power_of_2(E)
        num_warps = max(1, BLOCK_E // 1024) if T > ONE_WARP_TOKENS else 4
        route_kernel[(T,)](logits_TE.float().contiguous(), bias_E.float().contiguous(), ids, w,
                           E, float(scaling), TOP_K=top_k, KP2=triton.next_power_of_2(top_k),
                           RENORM=renormalize, BLOCK_E=BLOCK_E, num_warps=num_warps,
                           **launch_options(logits_TE.device))  # fmt: skip
    return ids, w


@triton.jit
def sort_slots_kernel(ids_ptr, token_ptr, pos_ptr, valid_ptr, offs_ptr, M, E, first_expert,
                      TOP_K: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                      PDL: tl.constexpr):  # fmt: skip
    wait_then_signal(PDL)
    p = tl.program_id(0)
    i = p * BLOCK + tl.arange(0, BLOCK)
    imask = i < M
    local = tl.load(ids_ptr + i, mask=imask, other=0) - first_expert
    held = (local >= 0) & (local < E)
    key_i = tl.where(held, local, E)  # another rank's experts sort after every group
    row = tl.zeros([BLOCK], dtype=tl.int32)
    expert = p * BLOCK + tl.arange(0, BLOCK)
    ends = tl.zeros([BLOCK], dtype=tl.int32)
    for j0 in range(0, M, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        jmask = j < M
        lj = tl.load(ids_ptr + j, mask=jmask, other=0) - first_expert
        key_j = tl.where(jmask, tl.where((lj >= 0) & (lj < E), lj, E), E + 1)
        before = (key_j[None, :] < key_i[:, None]) | (
            (key_j[None, :] == key_i[:, None]) & (j[None, :] < i[:, None])
        )
        row += tl.sum(before.to(tl.int32), axis=1)
        ends += tl.sum((key_j[None, :] <= expert[:, None]).to(tl.int32), axis=1)
    tl.store(pos_ptr + i, row.to(tl.int64), mask=imask)
    tl.store(token_ptr + row, (i // TOP_K).to(tl.int64), mask=imask)
    tl.store(valid_ptr + i, held.to(tl.uint8), mask=imask)
    tl.store(offs_ptr + expert, ends, mask=expert < E)


def sort_slots(ids_Tk: torch.Tensor, num_experts: int, first_expert: int = 0) -> SlotOrder:
    """`permute.sort_slots` on the device in one launch (M = T k <= MAX_SLOTS) or two."""
    T, k = ids_Tk.shape
    M = T * k
    dev = ids_Tk.device
    ids = ids_Tk.long().contiguous()
    token = torch.empty(M, dtype=torch.int64, device=dev)
    pos = torch.empty(M, dtype=torch.int64, device=dev)
    valid = torch.empty(M, dtype=torch.uint8, device=dev)
    offs = torch.empty(num_experts, dtype=torch.int32, device=dev)
    if M <= MAX_SLOTS:
        BLOCK = 64
        grid = (max(triton.cdiv(M, BLOCK), triton.cdiv(num_experts, BLOCK)),)
        sort_slots_kernel[grid](ids, token, pos, valid, offs, M, num_experts, first_expert,
                                TOP_K=k, BLOCK=BLOCK, CHUNK=64, **launch_options(dev))  # fmt: skip
    else:
        blocks, bins = triton.cdiv(M, SORT_BLOCK), triton.next_power_of_2(num_experts + 2)
        counts = torch.empty(blocks, bins, dtype=torch.int32, device=dev)
        common = dict(BLOCK=SORT_BLOCK, BINS=bins, num_warps=8, **launch_options(dev))
        block_counts_kernel[(blocks,)](ids, counts, M, num_experts, first_expert, **common)
        block_rows_kernel[(blocks,)](ids, counts, token, pos, valid, offs, M, num_experts,
                                     first_expert, blocks, TOP_K=k, **common)  # fmt: skip
    return SlotOrder(token, offs, pos.view(T, k), valid.view(torch.bool).view(T, k))


@triton.jit
def _block_keys(ids_ptr, M, E, first_expert, BLOCK: tl.constexpr):
    """(slots, keys) of this program's block: the local expert, E for another rank's, E + 1
    past the last slot."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    local = tl.load(ids_ptr + i, mask=i < M, other=0) - first_expert
    key = tl.where((local >= 0) & (local < E), local, E)
    return i, tl.where(i < M, key, E + 1).to(tl.int32)


# The blocked sort's sizes are not specialized: Triton compiles a kernel again for each new
# pattern of its integer arguments (multiple of 16 or not, equal to 1 or not), and M and
# num_blocks vary with the batch. At 8,192 tokens both are multiples of 16, at the warm-up's
# 1,147 neither; the first 6,016-token step of a cold Kimi Linear job (M a multiple of 16, 24
# blocks) compiled block_rows_kernel inside the job: 3.85 s of a 0.2 s step on an H100.
@triton.jit(do_not_specialize=["M"])
def block_counts_kernel(ids_ptr, counts_ptr, M, E, first_expert, BLOCK: tl.constexpr,
                        BINS: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    wait_then_signal(PDL)
    _, key = _block_keys(ids_ptr, M, E, first_expert, BLOCK)
    tl.store(counts_ptr + tl.program_id(0) * BINS + tl.arange(0, BINS), tl.histogram(key, BINS))


@triton.jit(do_not_specialize=["M", "num_blocks"])
def block_rows_kernel(ids_ptr, counts_ptr, token_ptr, pos_ptr, valid_ptr, offs_ptr, M, E,
                      first_expert, num_blocks, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                      BINS: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    wait_then_signal(PDL)
    b = tl.program_id(0)
    bins = tl.arange(0, BINS)
    total = tl.zeros([BINS], dtype=tl.int32)  # each key's slots in all blocks
    before = tl.zeros([BINS], dtype=tl.int32)  # ... in the blocks before this one
    mine = tl.zeros([BINS], dtype=tl.int32)  # ... in this one
    for bb in range(0, num_blocks):
        c = tl.load(counts_ptr + bb * BINS + bins)
        total += c
        before += tl.where(bb < b, c, 0)
        mine += tl.where(bb == b, c, 0)
    ends = tl.cumsum(total, 0)
    if b == 0:
        tl.store(offs_ptr + bins, ends, mask=bins < E)
    # slot s of key e, the j-th of e in this block's (key, slot) order at position p:
    # row = start_e + before_e + j, with j = p - (this block's slots of keys below e)
    shift = (ends - total) + before - (tl.cumsum(mine, 0) - mine)
    i, key = _block_keys(ids_ptr, M, E, first_expert, BLOCK)
    order = tl.sort(key * BLOCK + (i - b * BLOCK))
    skey = order // BLOCK
    slot = b * BLOCK + order % BLOCK
    row = tl.gather(shift, skey, 0) + tl.arange(0, BLOCK)
    ok = skey <= E
    tl.store(pos_ptr + slot, row.to(tl.int64), mask=ok)
    tl.store(token_ptr + row, (slot // TOP_K).to(tl.int64), mask=ok)
    tl.store(valid_ptr + i, (key < E).to(tl.uint8), mask=i < M)
