"""W4A16 grouped GEMM for decode (a few rows per expert) in Gluon, Triton's layout-explicit
dialect (`triton.experimental.gluon`): the packed MXFP4 words go from global memory straight
into the registers of the MMA's fragments, with no shared memory, barrier or layout conversion.
Same contract as `w4a16.grouped_mm_mxfp4` (rows [offs[e-1], offs[e]) of x times expert e's
weights; rows after offs[-1] unwritten) for the shapes `supported` accepts; the routed pass
(`experts.pick_gemm`) sends everything else to that kernel (Gluon has no CPU interpreter).

Each program computes 128 output columns x 8 rows of one expert: the weights are the MMA's A
operand (m16n8k16: 16 columns an instruction, half the Triton kernel's MMAs), the rows its N.
The MMA's K order is free as long as both operands share it, so it is chosen for the unpacking:
within a 256-input step, k-slot 32 j + 16 t + 8 b + 2 q + e carries input 64 q + 8 j + t + 4 b
+ 2 e. Thread q (lane % 4) then reads the 8 consecutive words 8 q .. 8 q + 7 of its columns
(two 16-byte loads), and one word of 8 codes, unpacked by the PTX of `w4a16._e2m1_words_bf16`
(12 instructions), is the A fragments of two k16 tiles; one asm unpacks the words of columns c
and c + 8 so that its outputs are the fragments' register quads. x's pairs are built to match
by 4 byte permutes per 8 inputs. x is read interleaved (`k3kernels.moe.interleave`: within
each 256-input step, the 16-byte chunk i of quarter q at position 4 i + q), so that a row's 4
threads read 64 contiguous bytes per load: read in place, each load touched 32 cache lines and
the kernel was bound by L1 (93% busy under ncu). The routed pass has its gather and activation
write that order (`interleaved=True`); other callers get a copy. Two K steps per loop
iteration, each loading the other's next step into registers, L2 prefetch 3-4 steps ahead, two
accumulators by k16-tile parity.
SASS (sm_90, triton 3.6 and 3.9): ~532 instructions per K step of 128 x 256 weights (the Triton
kernel: 688), 168 registers (3 programs an SM). At one and two tokens there are too few tiles to
keep the SMs busy, so K is split (`k_parts`) and the parts' fp32 products are summed by the
activation and the combine.

One H200, 7 k3-slice layers, both GEMMs, CUDA-graph replays, % of the copy bandwidth on the
packed bytes (`k3batch bench moe --expert-dtype mxfp4`, "gemm-mxfp4" against
"gemm-mxfp4-triton"; `benchmarks/kernels_h200.txt`, ninth session): tokens 1: 46% with K in 7
and 6 parts, its parts unsummed (the Triton kernel 29%), 2: 49 (44), 4: 67 (56), 8: 72 (62), 16:
77 (67), 64: 80 (70), 256: 77 (69). The whole routed pass, its kernels chained by programmatic
dependent launch (`k3kernels.pdl`): 32% (24), 44 (36), 56 (47), 66 (54), 73 (65), 79 (67), 74
(67). The grid's empty tile slots (the host cannot know how many tiles the routes make) come
first and exit while the kernel before still runs: +4 to 5 points from 8 tokens on.
Shape legend: M sorted rows, K input width, N output width, E experts.
"""

import functools

import torch

from k3kernels import INTERPRETED
from k3kernels.moe.grouped_gemm_triton import num_tile_slots, regime
from k3kernels.moe.interleave import STEP, gather_interleaved
from k3kernels.moe.mxfp4 import MXFP4Weight
from k3kernels.pdl import launch_options

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # a Triton without Gluon: the Triton kernel serves every shape
    gluon = None

BLOCK_N = 128  # output columns per program
BLOCK_M = 8  # rows per program (the MMA's N)
MAX_EXPERTS = 128  # the group-end scan's width
PROGRAMS_PER_SM = 5  # `k_parts`: K is split until the programs come nearest this many an SM


def supported(x: torch.Tensor, w: MXFP4Weight, num_rows: int | None = None) -> bool:
    """Whether this kernel takes x's rows (num_rows of them, default all) times w: bf16 rows on
    an sm_90+ GPU at decode sizes, K a multiple of 2 steps, N of 128, at most 128 experts,
    small scales (`MXFP4Weight`)."""
    E, N, K = w.shape
    M = x.shape[0] if num_rows is None else num_rows
    return (gluon is not None and not INTERPRETED and x.is_cuda
            and x.dtype == torch.bfloat16 and x.stride(-1) == 1
            and torch.cuda.get_device_capability(x.device) >= (9, 0)
            and regime(M, E) == "decode" and E <= MAX_EXPERTS
            and K % (2 * STEP) == 0 and N % BLOCK_N == 0 and w.small_scales
            and w.packed.is_contiguous() and w.scale.stride(-1) == 1)  # fmt: skip


def k_parts(num_rows: int, w: MXFP4Weight) -> int:
    """How many parts to split K into for num_rows sorted rows: the divisor of K / 512 whose
    program count (row tiles bound x column blocks x parts) is nearest `PROGRAMS_PER_SM` an SM.
    At one or two tokens the unsplit kernel has one program or fewer an SM (96 and 56 at one
    token, k3-slice), each alone on its schedulers; parts summed by the consumer (`moe_act`,
    `moe_combine`). One H200, 7 k3-slice layers, the two GEMMs (parts not summed; `benchmarks/
    kernels_h200.txt`, eighth session): one token 26% of copy unsplit, 40% at 7 and 6 parts
    (this rule's pick); two tokens 44% unsplit, 48-51% with the down GEMM in 2-6 parts; from 4
    tokens on no split gains (within 1 point at 4, 3 points slower at 8)."""
    E, N, K = w.shape
    programs = num_tile_slots(num_rows, E, BLOCK_M) * (N // BLOCK_N)
    target = PROGRAMS_PER_SM * _num_sms(w.packed.device)
    steps = K // (2 * STEP)
    return min((d for d in range(1, steps + 1) if steps % d == 0),
               key=lambda d: abs(programs * d - target))


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def grouped_mm_mxfp4_decode(x_MK: torch.Tensor, w: MXFP4Weight, offs_E: torch.Tensor,
                            interleaved: bool = False,
                            parts: int | None = 1) -> torch.Tensor:  # fmt: skip
    """out[r] = x[r] @ dequantize(w[e]).T for the rows r of group e (see the module doc); the
    caller checks `supported`. interleaved: x's columns are already in the order of
    `k3kernels.moe.interleave` (else a copy puts them so). parts: K split into this many parts
    of whole 512-input steps (None: `k_parts`); more than one gives their products unsummed,
    fp32 [parts, M, N]."""
    E, N, K = w.shape
    M = x_MK.shape[0]
    parts = k_parts(M, w) if parts is None else parts
    if K % (2 * STEP * parts):
        raise ValueError(f"K = {K} does not split into {parts} parts of 512-input steps")
    shape, dtype = ((M, N), x_MK.dtype) if parts == 1 else ((parts, M, N), torch.float32)
    out = torch.empty(shape, dtype=dtype, device=x_MK.device)
    xw = (x_MK if interleaved else gather_interleaved(x_MK)).view(torch.int32)
    qw = w.packed.view(torch.int32)
    grid = (num_tile_slots(M, E, BLOCK_M) * (N // BLOCK_N), parts)
    _w4a16_decode_kernel[grid](xw, qw, w.scale, out, offs_E, N, K, M, E, xw.stride(0),
                               qw.stride(0), qw.stride(1), w.scale.stride(0), w.scale.stride(1),
                               out.stride(-2), PARTS=parts, num_warps=4,
                               **launch_options(out.device))  # fmt: skip
    return out


if gluon is not None:
    # the MMA: 4 warps along the 128 columns (2 m16 tiles each), 8 rows
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 8])  # fmt: skip
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    # a step's words [j 8, q 4, c 64] of columns (c & 7) + 16 ((c >> 3) & 3) + 64 (c >> 5); the
    # same + 8 as a second tensor: the A fragments' register, lane and warp bits
    WORDS: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[1, 0, 0], [2, 0, 0], [4, 0, 0], [0, 0, 32]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
        warp_bases=[[0, 0, 8], [0, 0, 16]], block_bases=[], shape=[8, 4, 64])
    # scale bytes [2, q 4, c 64]: groups 2 q and 2 q + 1 of the step
    SCALES: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[1, 0, 0], [0, 0, 32]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
        warp_bases=[[0, 0, 8], [0, 0, 16]], block_bases=[], shape=[2, 4, 64])
    # interleaved x words [q 4, i 8, word 4, row 8]: thread (q, row) holds its quarter's 32
    X_WORDS: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
        lane_bases=[[1, 0, 0, 0], [2, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]],
        warp_bases=[[0, 0, 0, 0], [0, 0, 0, 0]], block_bases=[], shape=[4, 8, 4, 8])
    X_QIW: gl.constexpr = gl.SliceLayout(3, X_WORDS)
    X_QI: gl.constexpr = gl.SliceLayout(2, X_WORDS)
    # the experts' group ends, 4 a thread, whole in each warp: the scan and the sums that find a
    # program's tile stay within a warp (no shared memory, no barrier)
    EXPERTS: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
    OUT: gl.constexpr = gl.BlockedLayout([4, 1], [4, 8], [4, 1], [0, 1])

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _step(w, v, s, u, x, acc0, acc1):
        """One 256-input step: words w (columns c) and v (c + 8), their scale bytes s and u, x's
        words; the products into acc0 (k16 tiles with t = 0) and acc1 (t = 1)."""
        w = gl.reshape(w, [8, 4, 2, 4, 8])  # j, q, c as (c >> 5, (c >> 3) & 3, c & 7)
        v = gl.reshape(v, [8, 4, 2, 4, 8])
        w = gl.join(w, w)
        v = gl.join(v, v)
        w = gl.join(w, w)
        v = gl.join(v, v)  # + t, b
        w = gl.join(w, v)  # + h (column + 8)
        w = gl.join(w, w)  # + e: 16 copies of the two words per thread, in fragment order
        s = gl.join(s, s)
        s = gl.join(s, s)  # [jh, q, c, 2, 2]: j = 4 jh + 2 a + b
        s = gl.reshape(gl.permute(s, (0, 3, 4, 1, 2)), [8, 4, 2, 4, 8])
        u = gl.join(u, u)
        u = gl.join(u, u)
        u = gl.reshape(gl.permute(u, (0, 3, 4, 1, 2)), [8, 4, 2, 4, 8])
        s = gl.join(s, s)
        u = gl.join(u, u)
        s = gl.join(s, s)
        u = gl.join(u, u)
        s = gl.join(s, u)
        s = gl.join(s, s)
        # $8 / $10: the words of columns c and c + 8, $24 / $26 their scale bytes; outputs:
        # codes (0, 2), (4, 6), (1, 3), (5, 7) of each, interleaved by column: two A quads
        y = gl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 t, p, r;
            mad.lo.u32 p, $24, 0x00800080, 0x3F003F00;
            mad.lo.u32 r, $26, 0x00800080, 0x3F003F00;
            and.b32 t, $8, 0x81C081C0;
            mul.rn.bf16x2 $0, t, p;
            and.b32 t, $10, 0x81C081C0;
            mul.rn.bf16x2 $1, t, r;
            shf.r.wrap.b32 t, $8, $8, 3;
            and.b32 t, t, 0x81C081C0;
            mul.rn.bf16x2 $2, t, p;
            shf.r.wrap.b32 t, $10, $10, 3;
            and.b32 t, t, 0x81C081C0;
            mul.rn.bf16x2 $3, t, r;
            shf.r.wrap.b32 t, $8, $8, 6;
            and.b32 t, t, 0x81C081C0;
            mul.rn.bf16x2 $4, t, p;
            shf.r.wrap.b32 t, $10, $10, 6;
            and.b32 t, t, 0x81C081C0;
            mul.rn.bf16x2 $5, t, r;
            and.b32 t, $8, 0x001B001B;
            mul.lo.u32 t, t, 0x4108;
            and.b32 t, t, 0x81C081C0;
            mul.rn.bf16x2 $6, t, p;
            and.b32 t, $10, 0x001B001B;
            mul.lo.u32 t, t, 0x4108;
            and.b32 t, t, 0x81C081C0;
            mul.rn.bf16x2 $7, t, r;
            }
            """,
            constraints=("=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,"
                         "r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r"),
            args=[w, s], dtype=gl.bfloat16, is_pure=True, pack=16)
        # [j, q, g, w, r, t, b, h, e] -> [columns g w h r | k without t] for t = 0 and 1
        y0, y1 = gl.split(gl.permute(y, (2, 3, 7, 4, 0, 6, 1, 8, 5)))
        a0 = gl.convert_layout(gl.reshape(y0, [128, 128]), A_OP, assert_trivial=True)
        a1 = gl.convert_layout(gl.reshape(y1, [128, 128]), A_OP, assert_trivial=True)
        x = gl.reshape(x, [4, 32, 8])  # q, word 4 j + 2 w1 + w0, row
        x = gl.join(x, x)
        # pairs (input p, p + 2) from the words' halves: element d + 2 w0 + 4 w1 is e, b, t
        x = gl.inline_asm_elementwise(
            asm="prmt.b32 $0, $4, $6, 0x5410; prmt.b32 $1, $8, $10, 0x5410; "
                "prmt.b32 $2, $4, $6, 0x7632; prmt.b32 $3, $8, $10, 0x7632;",
            constraints="=r,=r,=r,=r,r,r,r,r,r,r,r,r", args=[x], dtype=gl.bfloat16,
            is_pure=True, pack=8)  # fmt: skip
        x = gl.reshape(x, [4, 8, 2, 2, 8, 2])  # q, j, t, b, row, e
        x0, x1 = gl.split(gl.permute(x, (1, 3, 0, 5, 4, 2)))  # j, b, q, e, row | t
        b0 = gl.convert_layout(gl.reshape(x0, [128, 8]), B_OP, assert_trivial=True)
        b1 = gl.convert_layout(gl.reshape(x1, [128, 8]), B_OP, assert_trivial=True)
        return mma_v2(a0, b0, acc0), mma_v2(a1, b1, acc1)

    @gluon.jit
    def _prefetch(ptrs, hi, step):
        """Step `step` of the words ptrs (a column's first word per thread) and ptrs + hi into
        L2."""
        gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                  [ptrs + step * 32], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                  [ptrs + hi + step * 32], dtype=gl.int32, is_pure=False,
                                  pack=1)  # fmt: skip

    @gluon.jit
    def _wait_then_signal(PDL: gl.constexpr):
        """`k3kernels.pdl.wait_then_signal` in Gluon."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, 0;", "=r", [],
                                      dtype=gl.int32, is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r",
                                      [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _load_step(w_ptrs, v_ptrs, s_ptrs, u_ptrs, x_ptrs, step):
        """Step `step`'s words (columns c and c + 8), their scale bytes and x's words."""
        return (gl.load(w_ptrs + step * 32), gl.load(v_ptrs + step * 32),
                gl.load(s_ptrs + step * 8).to(gl.int32), gl.load(u_ptrs + step * 8).to(gl.int32),
                gl.load(x_ptrs + step * 128))  # fmt: skip

    @gluon.jit
    def _columns(n_block, c):
        """Output column of index c of block n_block, in the A fragments' order (`WORDS`)."""
        return n_block * 128 + (c & 7) + ((c >> 3) & 3) * 16 + (c >> 5) * 64

    @gluon.jit
    def _grid(d, q, c):
        """d [D0] + q [4] + c [64] (slices of one 3D layout) broadcast to [D0, 4, 64]."""
        return (gl.expand_dims(gl.expand_dims(d, 1), 2) + gl.expand_dims(gl.expand_dims(q, 0), 2)
                + gl.expand_dims(gl.expand_dims(c, 0), 1))  # fmt: skip

    @gluon.jit
    def _w4a16_decode_kernel(x_ptr, q_ptr, s_ptr, out_ptr, offs_ptr, N, K, M, E, stride_xw,
                             stride_qe, stride_qn, stride_se, stride_sn,
                             stride_out, PARTS: gl.constexpr, PDL: gl.constexpr):  # fmt: skip
        """x_ptr: interleaved x as int32 words, q_ptr: the packed words as int32; strides in
        elements. Program (axis 0): tile t of the experts' 8-row tiles (expert-major) x column
        block, after the tile slots that no tile fills (the grid is the host's bound
        `num_tile_slots`: at 64 tokens ~40% of it); axis 1: its part of K (PARTS > 1: products
        into out[part]). With PDL the group ends (the slot sort's, two kernels or more back:
        `k3kernels.pdl`) are read and the tile found before the wait for the previous kernel
        (x's writer), so the programs of empty slots, scheduled first, exit while that kernel
        still runs (all but program 0, which keeps the chain's order)."""
        pid = gl.program_id(0)
        num_n = N // 128
        ee = gl.arange(0, 128, layout=EXPERTS)
        ends = gl.load(offs_ptr + ee, mask=ee < E, other=0)
        starts = gl.load(offs_ptr + ee - 1, mask=(ee > 0) & (ee < E), other=0)
        tiles = gl.where(ee < E, (ends - starts + 7) // 8, 0)
        tile_ends = gl.associative_scan(tiles, 0, _add)
        p = pid - (gl.num_programs(0) // num_n - gl.max(tile_ends, 0)) * num_n  # < 0: empty
        expert = gl.sum((tile_ends <= p // num_n).to(gl.int32), 0)
        mine = ee == expert
        group_size = gl.sum(gl.where(mine, tiles, 0), 0)
        local = p - (gl.sum(gl.where(mine, tile_ends, 0), 0) - group_size) * num_n
        first = gl.sum(gl.where(mine, starts, 0), 0) + (local % group_size) * 8
        n_block = local // group_size
        end = gl.sum(gl.where(mine, ends, 0), 0)

        steps = K // 256 // PARTS  # even (`grouped_mm_mxfp4_decode`)
        if PARTS > 1:  # the part's first step; scalar offsets (not the tiles': no registers)
            first_step = gl.program_id(1) * steps
            q_ptr += first_step * 32
            s_ptr += first_step * 8
            x_ptr += first_step * 128
            out_ptr += gl.program_id(1).to(gl.int64) * M * stride_out
        jj = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, WORDS)))
        qq = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, WORDS)))
        cc = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, WORDS)))
        w_ptrs = q_ptr + expert.to(gl.int64) * stride_qe + _grid(  # word 8 q + j of the step
            jj, qq * 8, _columns(n_block, cc).to(gl.int64) * stride_qn)
        v_ptrs = w_ptrs + 8 * stride_qn
        hs = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, SCALES)))
        qs = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, SCALES)))
        cs = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, SCALES)))
        s_ptrs = s_ptr + expert.to(gl.int64) * stride_se + _grid(  # group 2 q + jh
            hs, qs * 2, _columns(n_block, cs).to(gl.int64) * stride_sn)
        u_ptrs = s_ptrs + 8 * stride_sn
        pq = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(0, WORDS)))
        pc = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(0, WORDS)))
        p_ptrs = (q_ptr + expert.to(gl.int64) * stride_qe
                  + gl.expand_dims(_columns(n_block, pc).to(gl.int64) * stride_qn, 0)
                  + gl.expand_dims(pq * 8, 1))  # fmt: skip
        xq = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, X_QIW)))
        xi = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, X_QIW)))
        xw = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, X_QIW)))
        xr = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, X_QI)))
        rows = gl.minimum(first + xr, M - 1)  # rows past the group: read, not stored
        x_ptrs = (x_ptr + gl.expand_dims(gl.expand_dims(gl.expand_dims(
                      rows.to(gl.int64) * stride_xw, 0), 1), 2)
                  + gl.expand_dims(gl.expand_dims(gl.expand_dims(xq * 4, 1), 2)
                                   + gl.expand_dims(gl.expand_dims(xi * 16, 0), 2)
                                   + gl.expand_dims(gl.expand_dims(xw, 0), 1), 3))  # fmt: skip

        if (p < 0) & (pid > 0):
            return
        _wait_then_signal(PDL)
        if p < 0:
            return
        acc0 = gl.full([128, 8], 0.0, gl.float32, MMA)
        acc1 = gl.full([128, 8], 0.0, gl.float32, MMA)
        wA, vA, sA, uA, xA = _load_step(w_ptrs, v_ptrs, s_ptrs, u_ptrs, x_ptrs, 0)
        for i in range(0, steps, 2):
            wB, vB, sB, uB, xB = _load_step(w_ptrs, v_ptrs, s_ptrs, u_ptrs, x_ptrs, i + 1)
            _prefetch(p_ptrs, 8 * stride_qn, gl.minimum(i + 3, steps - 1))
            acc0, acc1 = _step(wA, vA, sA, uA, xA, acc0, acc1)
            wA, vA, sA, uA, xA = _load_step(w_ptrs, v_ptrs, s_ptrs, u_ptrs, x_ptrs,
                                            gl.minimum(i + 2, steps - 1))  # fmt: skip
            _prefetch(p_ptrs, 8 * stride_qn, gl.minimum(i + 4, steps - 1))
            acc0, acc1 = _step(wB, vB, sB, uB, xB, acc0, acc1)

        acc = gl.convert_layout(acc0 + acc1, OUT)
        on = gl.arange(0, 128, layout=gl.SliceLayout(1, OUT))
        orow = first + gl.arange(0, 8, layout=gl.SliceLayout(0, OUT))
        ocol = n_block * 128 + on
        o_ptrs = (out_ptr + gl.expand_dims(orow.to(gl.int64) * stride_out, 0)
                  + gl.expand_dims(ocol, 1))  # fmt: skip
        gl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty),
                 mask=gl.expand_dims(orow < end, 0) & gl.expand_dims(ocol < N, 1))
