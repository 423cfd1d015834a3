"""The MoE's routing and slot sort (`k3kernels.moe.route`, `permute.sort_slots`): the routing
kernel against `reference.route_reference`, the counting sort (decode) and the blocked sort
(prefill) equal to `permute.sort_slots`; under TRITON_INTERPRET=1 on CPU, on CUDA with `gpu`.
The blocked sort must compile once whatever the batch (its size arguments unspecialized)."""

import pytest
import torch
from k3kernels.moe import reference as R
from k3kernels.moe.permute import sort_slots

from k3batch.testing import assert_close


def test_sort_slots_groups_each_expert_in_slot_order():
    ids = torch.tensor([[3, 0], [1, 3], [0, 7], [3, 1]])  # expert 7: another rank's (E = 4)
    order = sort_slots(ids, 4)
    assert order.offs_E.dtype == torch.int32
    assert order.offs_E.tolist() == [2, 4, 4, 7]  # experts 0, 1, 2 (none), 3; slot 7 after
    assert order.token_M.tolist() == [0, 2, 1, 3, 0, 1, 3, 2]
    assert torch.equal(order.valid_Tk, ids < 4)
    flat = torch.empty(8, dtype=torch.long)
    flat[order.slot_pos_Tk.reshape(-1)] = torch.arange(8)
    assert torch.equal(flat // 2, order.token_M)  # slot_pos inverts the order
    ep = sort_slots(ids, 2, first_expert=2)  # a rank holding experts 2 and 3
    assert ep.offs_E.tolist() == [0, 3] and ep.token_M[:3].tolist() == [0, 1, 3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU")
def test_route_and_sort_interpreted_on_cpu(monkeypatch):
    from k3kernels.moe import route

    for T, E, k, first, local in ((1, 8, 2, 0, 8), (33, 8, 2, 4, 4), (70, 12, 3, 0, 12)):
        _check_route_and_sort(T, E, k, "cpu", first, local)
    monkeypatch.setattr(route, "ONE_WARP_TOKENS", 32)  # 33 tokens routed as a prefill's
    _check_route_and_sort(33, 8, 2, "cpu", 4, 4)
    _check_blocked_sort(700, 12, 3, "cpu", first_expert=3, local=6)  # 2 blocks, the last partial


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU")
def test_blocked_sort_compiles_once_whatever_the_batch(monkeypatch, sm90_recorder):
    """Triton compiles a kernel again for each new pattern of its integer arguments (multiple
    of 16 or not), and the blocked sort's slot count M and block count vary with the batch. A
    cold Kimi Linear job's one slow step (3.85 s of about 0.2, on an H100) was its first of
    6,016 tokens compiling block_rows_kernel: M a multiple of 16 and 24 blocks, a pair that
    neither the 8,192-token steps nor the warm-up's 1,147 had. Sorts of every pair (blocks of
    16 slots here) record one launch spec per kernel (`sm90.Recorder`: what Triton would
    compile apart), and each sorts as `permute.sort_slots` does."""
    from k3kernels.moe import route

    monkeypatch.setattr(route, "MAX_SLOTS", 16)  # the blocked sort from 17 slots, 16 a block
    monkeypatch.setattr(route, "SORT_BLOCK", 16)
    E, k = 8, 2
    # M = T k (multiple of 16 or not) over blocks of 16 (16 or 3: a multiple of 16 or not)
    for T in (128, 24, 23, 127):  # M 256 / 16 blocks, 48 / 3, 46 / 3, 254 / 16
        _check_blocked_sort(T, E, k, "cpu")
    for kernel in ("block_counts_kernel", "block_rows_kernel"):
        specs = [s for s in sm90_recorder.specs.values() if s["kernel"] == kernel
                 and s["constexprs"]["BLOCK"] == 16 and s["constexprs"]["BINS"] == 16]  # fmt: skip
        assert len(specs) == 1, (kernel, [s["aligned"] for s in specs])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_route_and_sort_gpu():
    """K3 (896 experts, top-16) and k3-slice (112, top-2) decode batches, an EP half; Kimi
    Linear's prefill (256, top-8: one warp a token); the two-launch sort at prefill sizes."""
    for T in (1, 16, 64):
        _check_route_and_sort(T, 896, 16, "cuda")
        _check_route_and_sort(T, 112, 2, "cuda")
    _check_route_and_sort(8192, 256, 8, "cuda")
    _check_route_and_sort(64, 896, 16, "cuda", first_expert=448, local=448)
    _check_blocked_sort(8192, 112, 2, "cuda")  # k3-slice prefill
    _check_blocked_sort(8192, 896, 16, "cuda", first_expert=448, local=448)  # K3, an EP half
    _check_blocked_sort(3000, 64, 1, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_blocked_sort_compiles_once_whatever_the_batch_gpu():
    """The interpreted test's claim where Triton really compiles: Kimi Linear's sort (256
    experts, top-8) at the warm-up's token counts, then at the job's steps after them (a
    cold job compiled block_rows_kernel at 6,016 tokens), compiles nothing more."""
    from k3batch.engine import compiles

    assert compiles.watch()
    for T in (8192, 1147):  # the warm-up's batches
        _check_blocked_sort(T, 256, 8, "cuda")
    compiles.take()
    for T in (8064, 6016, 2176):  # the end of a job's first wave
        _check_blocked_sort(T, 256, 8, "cuda")
    assert not {"block_counts_kernel", "block_rows_kernel"} & set(compiles.take())


def _check_route_and_sort(T, E, k, device, first_expert=0, local=None):
    """The routing kernel against `route_reference` (same ids, weights within fp32 rounding)
    and the counting sort against `permute.sort_slots` (equal)."""
    from k3kernels.moe import route

    g = torch.Generator(device=device).manual_seed(T * E + k)
    logits = torch.randn(T, E, generator=g, device=device) * 3
    bias = torch.randn(E, generator=g, device=device) * 0.1
    for renorm, scaling in ((True, 2.5), (False, 1.0)):
        ref_ids, ref_w = R.route_reference(logits, bias, k, renorm, scaling)
        ids, w = route.route(logits, bias, k, renorm, scaling)
        assert torch.equal(ids, ref_ids), (T, E, k)
        assert_close(f"route-T{T}-E{E}-k{k}", ref_w, w, rel_rms=1e-6)
    _check_sort_equal(ids, local or E, first_expert)


def _check_sort_equal(ids, local, first_expert):
    """`route.sort_slots` (one launch or two, by the slot count) equal to `permute.sort_slots`."""
    from k3kernels.moe import route

    got, ref = route.sort_slots(ids, local, first_expert), sort_slots(ids, local, first_expert)
    for name in ref._fields:
        assert torch.equal(getattr(got, name), getattr(ref, name)), (name, tuple(ids.shape), local)


def _check_blocked_sort(T, E, k, device, first_expert=0, local=None):
    """The two-launch sort of more than `route.MAX_SLOTS` slots against `permute.sort_slots`
    (equal), ids drawn unevenly (a few experts take most slots) with some on other ranks."""
    g = torch.Generator().manual_seed(T + E)
    ids = (torch.rand(T, k, generator=g) ** 3 * E).long().to(device)
    _check_sort_equal(ids, local or E, first_expert)
