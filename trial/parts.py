# scratch: where the routed-expert pass spends its time around the GEMMs (7 k3-slice layers)
import os
import torch
from k3batch.bench_kernels import time_ms
from k3batch.bench_moe import _layer_inputs
from k3batch.model import get_flavor
from k3kernels.moe.act import moe_act
from k3kernels.moe.combine import moe_combine
from k3kernels.moe.experts import fused_experts
from k3kernels.moe.grouped_gemm_triton import grouped_mm_triton
from k3kernels.moe.permute import sort_slots
OUT = os.environ["OUT"]
def log(*a):
    s = " ".join(str(x) for x in a); print(s, flush=True)
    open(f"{OUT}/parts.txt", "a").write(s + "\n")
def old_sort(ids, E):
    T, k = ids.shape
    local = ids.long()
    valid = (local >= 0) & (local < E)
    key = torch.where(valid, local, E).reshape(-1)
    order = torch.argsort(key, stable=True)
    offs = torch.searchsorted(key[order], torch.arange(E, device=key.device), right=True).to(torch.int32)
    rows = torch.arange(order.numel(), device=key.device)
    pos = torch.empty_like(order).scatter_(0, order, rows)
    return order // k, offs, pos.view(T, k), valid
cfg = get_flavor("k3-slice")
E = cfg.num_experts
gen = torch.Generator(device="cuda").manual_seed(0)
T = 8192
layers = [_layer_inputs(cfg, T, gen, "cuda") for _ in range(7)]
for x, w13, w2, ids, w in layers[:1]:
    a, b = old_sort(ids, E), sort_slots(ids, E)
    assert all(torch.equal(u, v) for u, v in zip(a, b)), "sorts differ"
orders = [sort_slots(ids, E) for _, _, _, ids, _ in layers]
xs = [x.index_select(0, o.token_M) for (x, *_), o in zip(layers, orders)]
hs = [grouped_mm_triton(xx, l[1], o.offs_E) for xx, l, o in zip(xs, layers, orders)]
hi = [moe_act(h, "situ") for h in hs]
ys = [grouped_mm_triton(h, l[2], o.offs_E) for h, l, o in zip(hi, layers, orders)]
parts = {
    "sort int64 (before)": lambda: [old_sort(l[3], E) for l in layers],
    "sort int16 (now)": lambda: [sort_slots(l[3], E) for l in layers],
    "gather x": lambda: [l[0].index_select(0, o.token_M) for l, o in zip(layers, orders)],
    "gate-up gemm": lambda: [grouped_mm_triton(xx, l[1], o.offs_E) for xx, l, o in zip(xs, layers, orders)],
    "act": lambda: [moe_act(h, "situ") for h in hs],
    "down gemm": lambda: [grouped_mm_triton(h, l[2], o.offs_E) for h, l, o in zip(hi, layers, orders)],
    "combine": lambda: [moe_combine(y, o.slot_pos_Tk, l[4], o.valid_Tk) for y, o, l in zip(ys, orders, layers)],
    "whole pass": lambda: [fused_experts(*l, act="situ", use_triton=True, gemm_impl="triton") for l in layers],
}
for rep in range(2):
    for name, fn in parts.items():
        log(rep, name, f"{time_ms(fn, 10):.3f} ms")
