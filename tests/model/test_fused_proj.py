"""Fused projections (`layers.FusedRows`): the Linear layers that read one input run as one GEMM
on a weight whose row blocks are their parameters, and the three KDA short convs as one launch.

Checked here: parameter names and memory are unchanged (each member a view of the fused weight,
no second copy); a model run, then loaded again with other weights (in place, by assignment, or
from a checkpoint), computes with the new weights; counted on the CPU, the GEMMs on weights and
the short-conv launches of a decode step per KDA, MLA and MoE sublayer; and a KDA layer's
plumbing into the Triton kernels (strided inputs, the conv's three-part output) against the
torch path, under the interpreter on the CPU.
"""

import collections

import pytest
import torch
from torch.overrides import TorchFunctionMode

from k3batch.model import K3Model, get_flavor
from k3batch.model.init import init_random_
from k3batch.model.kda import KimiDeltaAttention
from k3batch.model.layers import FusedRows, GatedMLP
from k3batch.model.loader import allocate_, load_model
from k3batch.model.mla import KimiMLAAttention
from k3batch.model.weights import load_weights_, plan_load, write_checkpoint
from k3batch.ops import kda as ops
from k3batch.testing import assert_close, slot_batch, slot_cache

FLAVORS = ("kimi-linear-debug", "k3-debug")
# The GEMMs a decode step runs on weights per sublayer, and short-conv launches per KDA layer.
# KDA: in_proj (q, k, v, f_a, b, g_a or g), then f_b and g_b as one bmm (Kimi Linear) or f_b
# alone (K3), o_proj. MLA: in_proj (q or q_a, kv_a, K3's gate), K3's q_b, absorb, unabsorb,
# o_proj. Router and shared experts (gate|up, down) apart; the dense FFN: gate|up, down.
EXPECTED = {
    "kimi-linear-debug": {"kda": 3, "mla": 4, "router": 1, "shared": 2, "mlp": 2, "conv": 1},
    "k3-debug": {"kda": 3, "mla": 5, "router": 1, "shared": 2, "mlp": 2, "conv": 1},
}
GEMMS = {
    torch.nn.functional.linear, torch.mm, torch.bmm, torch.matmul, torch.addmm, torch.baddbmm,
    torch.einsum, torch.Tensor.__matmul__, torch.Tensor.matmul, torch.Tensor.mm, torch.Tensor.bmm,
}  # fmt: skip


def _model(flavor: str, seed: int) -> K3Model:
    return init_random_(K3Model(get_flavor(flavor), dtype=torch.float32), seed=seed).eval()


def _ids(config, n: int = 5):
    return torch.randint(0, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))


def _fused(model) -> list[FusedRows]:
    return [v for m in model.modules() for v in vars(m).values() if isinstance(v, FusedRows)]


def _num_groups(module) -> int:
    """KDA: in_proj and the convs, and f_b|g_b with the low-rank gate; MLA: in_proj; the gated
    FFN: gate|up."""
    if isinstance(module, KimiDeltaAttention):
        return 2 + (not module.full_rank_gate)
    return int(isinstance(module, (KimiMLAAttention, GatedMLP)))


@pytest.mark.parametrize("flavor", FLAVORS)
@torch.no_grad()
def test_fused_params_keep_names_and_memory(flavor):
    """After a forward (which builds the fused weights), the parameters have their names and
    shapes, each member is a view of its group's weight in order, and the parameters' bytes
    are all the model's weight memory: no row is held twice."""
    model = _model(flavor, seed=0)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    model(_ids(model.config))
    assert {n: p.shape for n, p in model.named_parameters()} == shapes
    groups = _fused(model)
    assert len(groups) == sum(map(_num_groups, model.modules()))
    for rows in groups:
        w, row = rows.weight(), 0
        for name in rows.names:
            p = getattr(rows.parent, name).weight
            assert p.data_ptr() == w[row].data_ptr() and p.shape[1:] == w.shape[1:]
            row += p.shape[0]
        assert row == w.shape[0]
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in model.parameters()}  # fmt: skip
    assert sum(storages.values()) == sum(p.nbytes for p in model.parameters())


@pytest.mark.parametrize("flavor", FLAVORS)
@torch.no_grad()
def test_fused_model_reloaded_computes_with_new_weights(flavor):
    """A model run once (under inference_mode, as the engine runs it), then given other weights
    in place (`load_state_dict`), by assignment (new parameter objects) and after `allocate_`
    (fresh memory, as the loader does), gives exactly the outputs of a model built with those
    weights."""
    model = _model(flavor, seed=0)
    ids = _ids(model.config)
    with torch.inference_mode():
        first = model(ids)
    for seed, how in ((1, "copy"), (2, "assign"), (3, "allocate")):
        other = _model(flavor, seed=seed)
        expect = other(ids)
        if how == "allocate":
            allocate_(model, "cpu")
        model.load_state_dict(other.state_dict(), assign=how == "assign")
        out = model(ids)
        assert torch.equal(out, expect), how
        assert not torch.equal(out, first)


@torch.no_grad()
def test_fused_model_reloaded_from_checkpoint(tmp_path):
    """The checkpoint loader's in-place copies land in the fused weights of a model that ran."""
    flavor = "kimi-linear-debug"
    model = _model(flavor, seed=0)
    ids = _ids(model.config)
    model(ids)
    write_checkpoint(get_flavor(flavor), tmp_path, seed=4)
    load_weights_(model, plan_load(tmp_path, model))
    assert torch.equal(model(ids), load_model(tmp_path, dtype=torch.float32)(ids))


@pytest.mark.parametrize(
    "second,match",
    [(dict(bias=False, dtype=torch.float64), "cannot share one weight"), (dict(bias=True), "bias")],
    ids=["mixed-dtypes", "bias"],
)
def test_fused_rows_refuse_what_one_gemm_cannot_compute(second, match):
    parent = torch.nn.Module()
    parent.a = torch.nn.Linear(4, 3, bias=False)
    parent.b = torch.nn.Linear(4, 2, **second)
    with pytest.raises(ValueError, match=match):
        FusedRows(parent, ("a", "b")).weight()


class _GemmCounter(TorchFunctionMode):
    """Counts GEMM calls with a model weight among their operands, by the sublayer running
    (forward hooks keep a stack of sublayer kinds)."""

    def __init__(self, model):
        super().__init__()
        self.storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.counts = collections.Counter()
        self.stack = ["other"]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in GEMMS and any(
            isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages
            for t in (*args, *(kwargs or {}).values())
        ):
            self.counts[self.stack[-1]] += 1
        return func(*args, **(kwargs or {}))

    def watch(self, module, kind: str):
        def enter(*_):
            self.stack.append(kind)

        def leave(*_):
            self.stack.pop()

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)


def _decode_counts(model, monkeypatch):
    """(GEMMs on weights by sublayer kind, short-conv launches) of one decode step of 2
    sequences with cached prefixes, after a prefill that builds the fused weights."""
    cfg = model.config
    cache = slot_cache(cfg, range(cfg.num_hidden_layers), num_slots=2, max_seq_len=16,
                       device="cpu", dtype=torch.float32)  # fmt: skip
    ids = _ids(cfg, 8)[0]
    with torch.no_grad():
        model.forward_batch(ids, slot_batch(cache, [4, 4], [0, 0], [0, 1]), cache)
    counter = _GemmCounter(model)
    for layer in model.model.layers.values():
        counter.watch(layer.self_attn, cfg.layer_types[layer.layer_idx])
        if hasattr(layer, "mlp"):
            counter.watch(layer.mlp, "mlp")
        else:
            moe = layer.block_sparse_moe
            counter.watch(moe.gate, "router")
            counter.watch(moe.shared_experts, "shared")
            counter.watch(moe.experts, "routed")
    convs = collections.Counter()
    real = {n: getattr(ops, n) for n in ("short_conv", "short_conv_prefill_", "short_conv_decode_")}

    def counted(name):
        def run(*args, **kw):
            convs[name] += 1
            return real[name](*args, **kw)

        return run

    with monkeypatch.context() as mp, torch.no_grad(), counter:
        for name in real:
            mp.setattr(ops, name, counted(name))
        model.forward_batch(ids[:2], slot_batch(cache, [1, 1], [4, 4], [0, 1]), cache)
    return counter.counts, convs


@pytest.mark.parametrize("flavor", FLAVORS)
def test_decode_step_gemm_and_conv_launch_counts(flavor, monkeypatch):
    model = _model(flavor, seed=0)
    cfg = model.config
    counts, convs = _decode_counts(model, monkeypatch)
    layers = collections.Counter(cfg.layer_types[i] for i in range(cfg.num_hidden_layers))
    num_moe = sum(map(cfg.is_moe_layer, range(cfg.num_hidden_layers)))
    want = EXPECTED[flavor]
    assert counts["kda"] == want["kda"] * layers["kda"]
    assert counts["mla"] == want["mla"] * layers["mla"]
    assert counts["router"] == want["router"] * num_moe
    assert counts["shared"] == want["shared"] * num_moe
    assert counts["mlp"] == want["mlp"] * (cfg.num_hidden_layers - num_moe)
    assert convs == {"short_conv_decode_": want["conv"] * layers["kda"]}


# (seq_lens, cached_lens) of two sequences in blocks 0 and 1: a prefill of 5 and 1 tokens, then
# one decode step of each.
STEPS = (([5, 1], [0, 0]), ([1, 1], [5, 1]))


def _torch_path(real):
    def run(*args, backend, **kw):
        return real(*args, backend="torch", **kw)

    return run


@pytest.mark.parametrize("dt", ["fp32", "bf16"])
@pytest.mark.parametrize("flavor", FLAVORS)
def test_kda_layer_kernels_match_torch_path(flavor, dt, monkeypatch):
    """A KDA layer's cached prefill then decode step through the Triton kernels (`backend`
    "fla": one conv launch over q|k|v with the strided projection columns as input and its
    three contiguous parts as output; the decode step reading q, k, v and b as strided views)
    against the torch path. fla's own kernels (the chunked core, the gated norm) need a GPU:
    routed to the torch path here on both sides. Conv states are copies: exact. bf16: the
    interpreter rounds toward zero (~5e-3 measured)."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for name in ("gated_rms_norm", "kda_prefill_"):
        monkeypatch.setattr(ops, name, _torch_path(getattr(ops, name)))
    cfg = get_flavor(flavor)
    model = init_random_(K3Model(cfg, dtype=dtype), seed=0).to(dev).eval()
    attn = model.model.layers[str(cfg.kda_layers[0])].self_attn
    i = attn.layer_idx
    x = torch.randn(8, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(dev, dtype)
    runs = {}
    for backend in ("torch", "fla"):
        attn.backend = backend
        cache = slot_cache(cfg, [i], num_slots=2, max_seq_len=16, device=dev, dtype=dtype)
        outs, start = [], 0
        # cudnn off: the torch path's fp32 conv must not run in TF32 on a GPU
        with torch.no_grad(), torch.backends.cudnn.flags(enabled=False):
            for lens, cached in STEPS:
                batch = slot_batch(cache, lens, cached, [0, 1])
                cache.bind(batch)
                outs.append(attn(x[start : start + sum(lens)], batch, cache).float())
                start += sum(lens)
        runs[backend] = (torch.cat(outs), cache.kda_conv[i], cache.kda_state[i])
    (o_ref, conv_ref, state_ref), (o, conv, state) = runs["torch"], runs["fla"]
    rel_rms = 1e-5 if dtype == torch.float32 else 1e-2
    assert_close("kda_layer_o", o_ref, o, rel_rms=rel_rms)
    assert_close("kda_layer_state", state_ref, state, rel_rms=rel_rms)
    assert torch.equal(conv, conv_ref)
