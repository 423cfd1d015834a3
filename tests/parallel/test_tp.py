"""Decode ranks of a TP group with DCP against one device, in worker processes (gloo, fp32, CPU).

One fp32 random model prefills three prompts on one device; each request's cache is resharded
to every rank (`reshard_request`), the rank models get `shard_full_state_dict` weights, and the
ranks decode with the single device's greedy tokens as inputs (teacher forcing) and its expert
choices pinned; with DCP 1 the ranks also prefill the prompts (the path `k3batch bench layouts`
times as TP-N prefill), routes pinned, against the single device's prefill logits and caches.
The models: K3_MINI (k3batch.testing: k3-debug's layer schedule in 9 layers) and
kimi-linear-debug; K3_MINI has 2 KDA and 2 MLA heads, so TP 4 runs "k3-mini-h4" (the same model
with 4 of each). Exact (torch.equal): the handoff (reshard, gather back, stored slots, untouched
neighbours) and agreement between ranks (all-gathered logits, the same bits on every rank).
Close: TP and DCP change the order of fp32 sums (all-reduces, the expert combine, the LSE merge
of attention partials). Shallow models keep that rounding near its own size (the random
93-layer k3-debug amplifies a 1e-7 relative change about 1000-fold, see
tests/engine/test_engine.py), so the bounds can be tight. Measured (CPU, torch 2.13, 6 pinned
steps): logits max abs 0.7e-5 to 2.1e-5 and rel RMS 1.1e-6 to 2.1e-6 at TP 2/4 and DCP 1/2/4;
caches after decode max abs <= 2.1e-5, rel RMS per tensor <= 9.5e-6. Bounds: logits max abs
2e-4 and rel RMS 2e-5, cache tensors max abs 2e-4 and rel RMS 1e-4 (about 10x headroom). With
free routing (every TP and DCP case above), greedy tokens over 16 steps must equal the single
device's.
"""

import dataclasses
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3batch.model import K3Model, get_flavor
from k3batch.model.forward_batch import ForwardBatch
from k3batch.model.init import init_random_
from k3batch.parallel.context import merge_lse, partial_attention
from k3batch.parallel.group import ParallelGroup, create_groups
from k3batch.parallel.handoff import (
    ALIGN_BYTES,
    handoff_bytes,
    pack,
    reshard_request,
    unpack,
    unshard_request,
)
from k3batch.parallel.layout import ParallelLayout
from k3batch.parallel.tp import build_rank_model, load_rank_weights_, shard_full_state_dict
from k3batch.testing.simcluster import free_port
from k3batch.testing import K3_MINI, assert_close, slot_batch, slot_cache, slot_pages, slot_tensors

PROMPT_LENS = (5, 12, 19)
PINNED_STEPS, FREE_STEPS = 6, 16
MAX_SEQ_LEN = 48
LOGIT_MAX_ABS, LOGIT_REL_RMS = 2e-4, 2e-5
CACHE_MAX_ABS, CACHE_REL_RMS = 2e-4, 1e-4
RANK_SLOTS = [2, 0, 3]  # the ranks store the requests in other slots than the single device


def _request_cache(cache, slot: int, num_tokens: int) -> dict:
    return {
        kind: {i: t.clone() for i, t in layers.items()}
        for kind, layers in slot_tensors(cache, slot, num_tokens).items()
    }


def _rank_cache(config, layout, num_slots):
    return slot_cache(
        config, range(config.num_hidden_layers), num_slots=num_slots, max_seq_len=MAX_SEQ_LEN,
        device="cpu", dtype=torch.float32, tp_size=layout.tp_size, dcp_size=layout.dcp_size,
    )  # fmt: skip


@dataclasses.dataclass
class Reference:
    model: K3Model
    before: list[dict]  # per request: cache after prefill
    after: list[dict]  # per request: cache after PINNED_STEPS decode steps
    tokens: torch.Tensor  # [FREE_STEPS + 1, B]: decode inputs (greedy tokens)
    logits: torch.Tensor  # [FREE_STEPS, B, V]
    routes: list[dict]  # per step: {layer: [B, top_k] expert ids}
    prompt_ids: torch.Tensor  # [sum(PROMPT_LENS)]: the prompts, packed
    prefill_logits: torch.Tensor  # [B, V]
    prefill_routes: dict  # {layer: [sum(PROMPT_LENS), top_k] expert ids}


_REFERENCES = {}


def _config(name: str):
    """A flavor, "k3-mini" (k3batch.testing.K3_MINI) or "k3-mini-h4": the same model with 4 KDA
    and 4 MLA heads (it has 2 of each, which TP 4 cannot split)."""
    if name == "k3-mini":
        return K3_MINI
    if name == "k3-mini-h4":
        return dataclasses.replace(K3_MINI, kda_num_heads=4, num_attention_heads=4)
    return get_flavor(name)


def _reference(name: str) -> Reference:
    """Prefill the prompts (one chunk each), then FREE_STEPS greedy decode steps, on one device."""
    if name in _REFERENCES:
        return _REFERENCES[name]
    model = init_random_(K3Model(_config(name), dtype=torch.float32), seed=0).eval()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in PROMPT_LENS]
    cache = _rank_cache(model.config, ParallelLayout(tp_size=1), len(prompts))
    B = len(prompts)
    with torch.no_grad():
        b = slot_batch(cache, PROMPT_LENS, [0] * B, range(B), routes_out={})
        prefill_logits = model.forward_batch(torch.cat(prompts), b, cache)
        prefill_routes, tokens = b.routes_out, [prefill_logits.argmax(-1)]
        before = [_request_cache(cache, s, n) for s, n in enumerate(PROMPT_LENS)]
        logits, routes = [], []
        for t in range(FREE_STEPS):
            b = slot_batch(cache, [1] * B, [n + t for n in PROMPT_LENS], range(B), routes_out={})
            logits.append(model.forward_batch(tokens[-1], b, cache))
            tokens.append(logits[-1].argmax(-1))
            routes.append(b.routes_out)
            if t + 1 == PINNED_STEPS:
                after = [
                    _request_cache(cache, s, n + PINNED_STEPS) for s, n in enumerate(PROMPT_LENS)
                ]
    ref = Reference(
        model, before, after, torch.stack(tokens), torch.stack(logits), routes,
        torch.cat(prompts), prefill_logits, prefill_routes,
    )  # fmt: skip
    _REFERENCES[name] = ref
    return ref


# ---- worker processes --------------------------------------------------------------------------


def _decode(model, cache, data, *, pinned: bool):
    """Decode steps on a rank: teacher-forced and pinned, or free (own greedy tokens)."""
    B = len(PROMPT_LENS)
    tokens = data["tokens"][0]
    logits, out_tokens = [], []
    for t in range(PINNED_STEPS if pinned else FREE_STEPS):
        b = slot_batch(
            cache,
            [1] * B,
            [n + t for n in PROMPT_LENS],
            RANK_SLOTS,
            pinned_routes=data["routes"][t] if pinned else None,
        )
        with torch.no_grad():
            logits.append(model.forward_batch(tokens, b, cache))
        out_tokens.append(logits[-1].argmax(-1))
        tokens = data["tokens"][t + 1] if pinned else out_tokens[-1]
    return torch.stack(logits), torch.stack(out_tokens)


def _worker(rank: int, world: int, port: int, in_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        data = torch.load(in_path, weights_only=False)
        config = data["config"]
        results = {}
        for dcp in data["dcp_sizes"]:
            layout = ParallelLayout(tp_size=world, dcp_size=dcp)
            tp, dcp_group = create_groups(layout)
            model = build_rank_model(
                config, layout, tp, dcp_group, dtype=torch.float32, device="cpu"
            )
            model.load_state_dict(data["shards"][rank], strict=True)
            out = {}
            for pinned in (True, False) if dcp in data["free_dcps"] else (True,):
                cache = _rank_cache(config, layout, 4)
                for slot, pieces in zip(RANK_SLOTS, data["pieces"][dcp][rank]):
                    cache.write_request_(slot, slot_pages(cache, slot), pieces)
                logits, tokens = _decode(model, cache, data, pinned=pinned)
                if pinned:
                    out["logits"] = logits
                    local_len = cache.pages_per_slot * cache.page_size
                    out["cache"] = [_request_cache(cache, s, local_len) for s in RANK_SLOTS]
                else:
                    out["tokens"] = tokens
            if dcp == 1:  # TP prefill (a rank with DCP runs decode only)
                cache = _rank_cache(config, layout, len(PROMPT_LENS))
                B = len(PROMPT_LENS)
                b = slot_batch(cache, PROMPT_LENS, [0] * B, range(B),
                               pinned_routes=data["prefill_routes"])  # fmt: skip
                with torch.no_grad():
                    out["prefill_logits"] = model.forward_batch(data["prompt_ids"], b, cache)
                out["prefill_cache"] = [
                    _request_cache(cache, s, n) for s, n in enumerate(PROMPT_LENS)
                ]
            results[dcp] = out
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# (model, tp_size, DCP sizes run in one set of workers, the DCP sizes that also run free routing)
CASES = [
    pytest.param("k3-mini", 2, (1, 2), (1, 2), id="k3-mini-tp2-dcp1,2"),
    pytest.param("k3-mini-h4", 4, (1, 2, 4), (1, 2, 4), id="k3-mini-h4-tp4-dcp1,2,4"),
    pytest.param("kimi-linear-debug", 2, (2,), (2,), id="kimi-linear-debug-tp2-dcp2"),
]


@pytest.mark.parametrize("model_name, tp_size, dcp_sizes, free_dcps", CASES)
def test_rank_decode_matches_one_device(tmp_path, model_name, tp_size, dcp_sizes, free_dcps):
    ref = _reference(model_name)
    config = ref.model.config
    pieces = {
        dcp: [
            [reshard_request(c, config, ParallelLayout(tp_size=tp_size, dcp_size=dcp), r)
             for c in ref.before]
            for r in range(tp_size)
        ]
        for dcp in dcp_sizes
    }  # fmt: skip
    layout = ParallelLayout(tp_size=tp_size)
    data = {
        "config": config,
        "dcp_sizes": dcp_sizes,
        "free_dcps": free_dcps,
        "shards": [shard_full_state_dict(ref.model, layout, r) for r in range(tp_size)],
        "pieces": pieces,
        "tokens": ref.tokens,
        "routes": ref.routes,
        "prompt_ids": ref.prompt_ids,
        "prefill_routes": ref.prefill_routes,
    }
    torch.save(data, tmp_path / "inputs.pt")
    args = (tp_size, free_port(), str(tmp_path / "inputs.pt"), str(tmp_path))
    # forkserver: one fresh server process imports this module (torch, k3batch) once and forks
    # each rank from it (spawn made every rank import torch again: ~3.5 s of CPU each); fork
    # itself would copy this process's threads (Ray's, from earlier tests)
    mp.set_forkserver_preload([__name__])
    mp.start_processes(_worker, args=args, nprocs=tp_size, join=True, start_method="forkserver")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(tp_size)]
    for dcp in dcp_sizes:
        name = f"{model_name}-tp{tp_size}-dcp{dcp}"
        out = results[0][dcp]
        for r in range(1, tp_size):  # logits are all-gathered: the same bits everywhere
            assert torch.equal(results[r][dcp]["logits"], out["logits"]), (name, r)
        m = assert_close(
            f"{name} logits",
            ref.logits[:PINNED_STEPS],
            out["logits"],
            rel_rms=LOGIT_REL_RMS,
            max_abs=LOGIT_MAX_ABS,
        )
        print(f"{name}: logits rel_rms {m['rel_rms']:.2e} max_abs {m['max_abs']:.2e}")
        if dcp in free_dcps:
            assert torch.equal(out["tokens"], ref.tokens[1:]), f"{name}: free greedy tokens differ"
        if dcp == 1:  # TP prefill against one device: logits and every rank's cache
            assert_close(f"{name} prefill logits", ref.prefill_logits, out["prefill_logits"],
                         rel_rms=LOGIT_REL_RMS, max_abs=LOGIT_MAX_ABS)  # fmt: skip
            for r in range(tp_size):
                for b, full in enumerate(ref.before):
                    want = reshard_request(full, config, ParallelLayout(tp_size=tp_size), r)
                    got = results[r][1]["prefill_cache"][b]
                    for kind, layers in want.items():
                        for i, t in layers.items():
                            assert_close(f"{name} rank {r} prefill {kind}[{i}]", t,
                                         got[kind][i], rel_rms=CACHE_REL_RMS,
                                         max_abs=CACHE_MAX_ABS)  # fmt: skip
        layout = ParallelLayout(tp_size=tp_size, dcp_size=dcp)
        cache_err = cache_rel = 0.0
        for r in range(tp_size):
            for b, full in enumerate(ref.after):
                want = reshard_request(full, config, layout, r)
                got = results[r][dcp]["cache"][b]
                for kind, layers in want.items():
                    for i, t in layers.items():
                        stored = got[kind][i][: t.shape[0]]
                        c = assert_close(
                            f"{name} rank {r} {kind}[{i}]",
                            t,
                            stored,
                            rel_rms=CACHE_REL_RMS,
                            max_abs=CACHE_MAX_ABS,
                        )
                        cache_err = max(cache_err, c["max_abs"])
                        cache_rel = max(cache_rel, c["rel_rms"])
        print(f"{name}: cache rel_rms {cache_rel:.2e} max_abs {cache_err:.2e}")


# ---- single-process tests ------------------------------------------------------------------


@pytest.mark.parametrize("tp_size, dcp_size", [(2, 1), (2, 2), (4, 2), (4, 4)])
def test_handoff_is_exact(tp_size, dcp_size):
    ref = _reference("k3-mini" if tp_size == 2 else "k3-mini-h4")
    config = ref.model.config
    layout = ParallelLayout(tp_size=tp_size, dcp_size=dcp_size)
    for b, full in enumerate(ref.before):
        pieces = [reshard_request(full, config, layout, r) for r in range(tp_size)]
        back = unshard_request(pieces, layout)
        for kind, layers in full.items():
            assert sorted(back[kind]) == sorted(layers)
            for i, t in layers.items():
                assert torch.equal(back[kind][i], t), (kind, i)
        for r, p in enumerate(pieces):
            cache = _rank_cache(config, layout, 3)
            cache.arena.fill_(0xFF)  # poison: bytes outside slot 1 must stay untouched
            before = cache.arena.clone()
            cache.write_request_(1, slot_pages(cache, 1), unpack(*pack(p, "cpu")))  # the wire
            num_tokens = len(next(iter(full["mla_latent"].values())))
            got = slot_tensors(cache, 1, -(-num_tokens // dcp_size))
            heads = config.kda_num_heads // tp_size
            channels = heads * config.kda_head_dim
            for i, t in full["kda_state"].items():
                assert torch.equal(got["kda_state"][i], t[r * heads : (r + 1) * heads])
            for i, t in full["kda_conv"].items():
                assert torch.equal(got["kda_conv"][i], t[:, r * channels : (r + 1) * channels])
            for i, t in full["mla_latent"].items():
                rows = t[r % dcp_size :: dcp_size]
                assert torch.equal(got["mla_latent"][i][: rows.shape[0]], rows)
            allowed = torch.zeros_like(before, dtype=torch.bool)
            bb, pb = cache.layout.block_bytes, cache.layout.page_bytes
            allowed[bb : 2 * bb] = True
            for j in slot_pages(cache, 1):
                allowed[cache.total_bytes - (j + 1) * pb : cache.total_bytes - j * pb] = True
            assert not ((cache.arena != before) & ~allowed).any()
        total = sum(handoff_bytes(p) for p in pieces[:dcp_size])  # one DCP group holds MLA once
        kda = sum(handoff_bytes({k: full[k]}) for k in ("kda_state", "kda_conv"))
        assert total == kda * dcp_size // tp_size + handoff_bytes(
            {"mla_latent": full["mla_latent"]}
        )
    # a subset of layers (one pipeline stage: the first AttnRes block) reshards on its own
    stage = {k: {i: t for i, t in v.items() if i < 4} for k, v in ref.before[0].items()}
    piece = reshard_request(stage, config, layout, tp_size - 1)
    assert all(i < 4 for v in piece.values() for i in v) and piece["kda_state"]


def test_packed_handoff_keeps_dtypes_shapes_and_bits():
    """A rank's pieces through one byte buffer: fp32 states and bf16 conv states and latents of
    sizes that are not multiples of the alignment, strided views (a DCP stripe) included."""
    g = torch.Generator().manual_seed(0)
    latent = torch.randn(7, 5, generator=g).to(torch.bfloat16)
    pieces = {
        "kda_state": {1: torch.randn(3, 5, 5, generator=g), 3: torch.randn(3, 5, 5, generator=g)},
        "kda_conv": {1: torch.randn(3, 6, 3, generator=g).to(torch.bfloat16)},
        "mla_latent": {2: latent[1::2]},
    }
    buf, manifest = pack(pieces, "cpu")
    assert buf.dtype == torch.uint8 and buf.numel() == manifest.num_bytes
    assert all(start % ALIGN_BYTES == 0 for *_, start in manifest.entries)
    assert handoff_bytes(pieces) <= manifest.num_bytes < handoff_bytes(pieces) + 4 * ALIGN_BYTES
    back = unpack(buf.clone(), manifest)
    for kind, layers in pieces.items():
        assert sorted(back[kind]) == sorted(layers)
        for i, t in layers.items():
            assert back[kind][i].dtype == t.dtype and torch.equal(back[kind][i], t), (kind, i)
    with pytest.raises(ValueError, match="manifest"):
        unpack(buf[:-1], manifest)


def test_merge_lse_equals_softmax_over_all_tokens():
    g = torch.Generator().manual_seed(0)
    B, H, S, L, R, M = 3, 4, 11, 32, 8, 4
    q = torch.randn(B, H, L + R, generator=g)
    latent = torch.randn(B, S, L + R, generator=g)
    lens = torch.tensor([11, 2, 6])  # sequence 1: DCP ranks 2 and 3 hold no token
    scale = 0.2
    scores = torch.einsum("bhc,bsc->bhs", q, latent) * scale
    scores = scores.masked_fill(torch.arange(S)[None, None] >= lens[:, None, None], float("-inf"))
    want = torch.einsum("bhs,bsl->bhl", torch.softmax(scores, -1), latent[..., :L])
    outs, lses = [], []
    for d in range(M):
        local = latent[:, d::M]
        num_local = ((lens - d - 1) // M + 1).clamp_min(0)
        mask = torch.arange(local.shape[1])[None] >= num_local[:, None]
        o, lse = partial_attention(q, local, mask, kv_lora=L, scale=scale)
        outs.append(o)
        lses.append(lse)
    assert torch.isinf(lses[3][1]).all()
    got, lse = merge_lse(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=0, atol=1e-5)


def test_layout_validate_errors():
    config = get_flavor("k3-debug")
    ParallelLayout(tp_size=2, dcp_size=2).validate(config)
    with pytest.raises(ValueError, match="dcp_size = 3 must divide tp_size = 4"):
        ParallelLayout(tp_size=4, dcp_size=3).validate()
    with pytest.raises(ValueError, match="tp_size = 3 does not divide kda_num_heads = 2"):
        ParallelLayout(tp_size=3).validate(config)
    wide = dataclasses.replace(config, kda_num_heads=8, num_attention_heads=8, num_experts=16)
    with pytest.raises(ValueError, match="tp_size = 4 does not divide num_experts = 6"):
        ParallelLayout(tp_size=4).validate(dataclasses.replace(wide, num_experts=6))
    with pytest.raises(ValueError, match="tp_size = 4 does not divide num_attention_heads = 2"):
        ParallelLayout(tp_size=4).validate(dataclasses.replace(wide, num_attention_heads=2))
    with pytest.raises(ValueError, match="tp_size = 8 does not divide vocab_size = 516"):
        ParallelLayout(tp_size=8).validate(dataclasses.replace(wide, vocab_size=516))
    with pytest.raises(ValueError, match="intermediate_size = 132"):
        ParallelLayout(tp_size=8).validate(dataclasses.replace(wide, intermediate_size=132))
    with pytest.raises(ValueError, match="must be >= 1"):
        ParallelLayout(tp_size=0).validate()
    with pytest.raises(RuntimeError, match="detached"):
        ParallelGroup.detached(1, 2).all_reduce(torch.zeros(1))


def test_rank_model_prefill_with_dcp_raises():
    config = get_flavor("kimi-linear-debug")
    layout = ParallelLayout(tp_size=2, dcp_size=2)
    tp, dcp = ParallelGroup.detached(0, 2), ParallelGroup.detached(0, 2)
    model = build_rank_model(config, layout, tp, dcp, dtype=torch.float32, device="cpu")
    cache = _rank_cache(config, layout, 1)
    with pytest.raises(ValueError, match="decode only"):
        model.forward_batch(torch.zeros(2, dtype=torch.long), ForwardBatch([2], [0], [0]), cache)
    with pytest.raises(ValueError, match="decode only"):  # the MLA layer checks on its own too
        model.model.layers["3"].self_attn(
            torch.zeros(2, config.hidden_size), ForwardBatch([2], [0], [0]), cache
        )


def test_load_rank_weights_reads_the_shards(mini_model_dir):
    from k3batch.model.loader import load_model

    for expert_dtype in ("bf16", "mxfp4"):  # dequantized at load, or kept packed
        full = load_model(mini_model_dir, dtype=torch.float32, expert_dtype=expert_dtype)
        for tp_size in (1, 2):  # K3_MINI's 2 heads allow no more
            layout = ParallelLayout(tp_size=tp_size, dcp_size=tp_size)
            for r in range(tp_size):
                tp, dcp = ParallelGroup.detached(r, tp_size), ParallelGroup.detached(r, tp_size)
                model = build_rank_model(full.config, layout, tp, dcp, dtype=torch.float32,
                                         device="cpu", expert_dtype=expert_dtype)  # fmt: skip
                load_rank_weights_(model, mini_model_dir, layout, r)
                want = shard_full_state_dict(full, layout, r)
                got = model.state_dict()
                assert sorted(got) == sorted(want)
                for name, t in want.items():
                    assert torch.equal(got[name], t), (expert_dtype, tp_size, r, name)
