"""The decode roofline's byte count on the full K3 shape (meta device) against the spec's
figures (sections 8 and 9), its FLOPs and where they bind, kimi-linear's prefill and decode
counts against a hand count, and the route counter on k3-debug."""

import torch

from k3batch.model import K3Model, get_flavor
from k3batch.model.forward_batch import ForwardBatch
from k3batch.bench.roofline import BF16_TFLOPS, COPY_TBPS, RouteCounter, decode_floor, roofline_ms


def _k3():
    with torch.device("meta"):
        return K3Model(get_flavor("k3"), dtype=torch.bfloat16)


def test_decode_bytes_match_the_spec_on_k3():
    model = _k3()
    cfg = model.config
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    one = decode_floor(model, context_lens=[1000], experts_selected={})
    # KDA: 54,263,808 B of state and 1,907,712 B of conv per request per TP8 rank (spec 8),
    # read and written.
    assert one.bytes['kda'] == 2 * 8 * (54_263_808 + 1_907_712)
    # MLA: 27,648 B per token (spec 8), 1000 cached tokens plus the new one.
    assert one.bytes['mla'] == 1001 * 27_648
    assert one.bytes['experts'] == 0
    # Every expert selected, every embedding row read: all the weights, once.
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    V, D = cfg.vocab_size, cfg.hidden_size
    everything = decode_floor(
        model, context_lens=[0] * V, experts_selected={i: cfg.num_experts for i in moe_layers}
    )
    assert everything.bytes['dense'] + everything.bytes['experts'] == total
    # 16 of 896 experts in each of the 92 MoE layers: 16/896 of the routed bytes.
    sparse = decode_floor(model, context_lens=[0], experts_selected={i: 16 for i in moe_layers})
    assert sparse.bytes['experts'] == everything.bytes['experts'] * 16 // 896
    assert one.bytes['dense'] == everything.bytes['dense'] - (V - 1) * D * 2


def test_decode_flops_and_where_they_bind():
    """FLOPs: 2 per weight and sequence outside the routed experts and the embedding, 2 per
    weight of k experts per slot, the absorbed MLA's 2 (576 + 512) per cached token and head.
    On k3-slice one sequence is bound by bytes everywhere; 256 are bound by the dense FLOPs."""
    with torch.device("meta"):
        model = K3Model(get_flavor("k3-slice"), dtype=torch.bfloat16)
    cfg = model.config
    params = sum(p.numel() for n, p in model.named_parameters()
                 if ".experts." not in n and n != "model.embed_tokens.weight")  # fmt: skip
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    one = decode_floor(model, context_lens=[1023], experts_selected=dict.fromkeys(moe, 2))
    assert one.flops["dense"] == 2 * params and one.flops["kda"] == 0
    assert one.flops["experts"] == 7 * 2 * 2 * 3 * 3584 * 3072
    assert one.flops["mla"] == 2 * 1024 * cfg.num_attention_heads * 2 * (576 + 512)
    assert one.ms() == {c: one.bytes[c] / COPY_TBPS / 1e9 for c in one.bytes}
    many = decode_floor(model, context_lens=[1023] * 256, experts_selected=dict.fromkeys(moe, 112))
    assert many.ms()["dense"] == many.flops["dense"] / BF16_TFLOPS / 1e9
    assert many.ms()["kda"] == many.bytes["kda"] / COPY_TBPS / 1e9
    assert many.floor_ms() == sum(many.ms().values()) > sum(many.bytes.values()) / COPY_TBPS / 1e9
    assert roofline_ms(1e12, 0) == 1000 / BF16_TFLOPS


def test_route_counter_counts_distinct_experts(model_factory):
    model = model_factory("k3-debug")
    batch = ForwardBatch.fresh([5])
    batch.routes_out = {}
    ids = torch.arange(5)
    with RouteCounter(model) as rc, torch.no_grad():
        model.forward_batch(ids, batch, all_logits=True)
    assert sorted(rc.selected) == sorted(batch.routes_out)
    for layer, routes in batch.routes_out.items():
        assert rc.selected[layer] == len(set(routes.flatten().tolist()))
    assert not model.model.layers["1"].block_sparse_moe.gate._forward_hooks  # removed


def test_moe_roofline_is_bytes_at_k3_slice_prefill():
    """`bench moe`'s floor at k3-slice prefill (7 layers, 8,192 tokens, every expert touched):
    the 51.8 GB of bf16 experts at the copy bandwidth (12.2 ms) outlast the 7.58 TFLOP at the
    bf16 peak (9.8 ms), so 60% of that peak is 75% of the roofline; at 64 tokens the bytes
    alone count."""

    cfg = get_flavor("k3-slice")
    D, I, E = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    layers, k = 7, cfg.num_experts_per_token
    flops, weights = layers * 2 * 8192 * k * 3 * D * I, layers * E * 3 * D * I * 2
    floor = roofline_ms(flops, weights)
    assert round(weights / 1e9, 1) == 51.8 and round(floor, 1) == 12.2
    assert round(flops / BF16_TFLOPS / 1e9, 1) == 9.8
    assert round(floor / (flops / (0.6 * BF16_TFLOPS) / 1e9), 2) == 0.75
    assert roofline_ms(flops / 128, weights) == floor


def test_clock_samples_and_the_moe_table():
    """`bench moe --clocks`: nvidia-smi's "MHz, W" lines reduce to medians (unreadable lines
    skipped, none readable: no figures), and the table shows the two columns only then."""
    from k3batch.bench.kernels import clock_medians
    from k3batch.bench.moe import format_moe_table

    smi = "1335, 695.48\n1980, 142.58\n[N/A], [N/A]\n1305, 696.01\n"
    assert clock_medians(smi) == {"sm_mhz": 1335, "watts": 695.5}
    assert clock_medians("[N/A], [N/A]\n") == {} and clock_medians("") == {}
    row = {"impl": "experts-triton", "flavor": "k3-slice", "layers": 7, "tokens": 8192,
           "ms": 19.2, "tflops": 394.0, "weight_tbps": 2.69, "pct_peak": 50.7,
           "pct_roofline": 63.2}  # fmt: skip
    plain = format_moe_table([row])
    assert "SM MHz" not in plain and plain.splitlines()[-1].endswith("63.2%")
    clocked = format_moe_table([row | clock_medians(smi)])
    assert "SM MHz" in clocked and clocked.splitlines()[-1].endswith("|    1335 |  695.5")


def test_profile_summary_on_cpu():
    """`bench engine --profile` / `bench moe --profile`'s summary: without CUDA the top ops by
    self CPU time, each with its share, and the table that prints them."""
    import time

    from k3batch.bench.engine import format_profile, profile_ops

    a = torch.randn(256, 256)

    def run():
        t0 = time.perf_counter()
        for _ in range(3):
            a @ a
        return time.perf_counter() - t0

    prof = profile_ops(run, cuda=False, top=5)
    ops = {o["op"]: o for o in prof["ops"]}
    assert "aten::mm" in ops and ops["aten::mm"]["calls"] == 3 and len(ops) <= 5
    assert 0 < ops["aten::mm"]["pct"] <= 100 and prof["wall_ms"] > 0
    table = format_profile(prof, "3 products").splitlines()
    assert table[0].startswith("3 products under the profiler") and len(table) == 2 + len(ops)


def test_kimi_linear_counts_by_hand():
    """kimi-linear's prefill FLOPs and decode floor against a count written out from the public
    config, tensor by tensor, not by walking the model: hidden 2,304; 20 KDA layers (32 heads of
    128, conv 4, low-rank f and g of rank 128); 7 MLA layers at 0-based 3, 7, ..., 23, 26 (32
    heads, q_proj without LoRA, no output gate, latents 512 + 64); the dense FFN (9,216) in layer
    0; 26 MoE layers of 256 experts of 1,024, top 8, one shared; vocab 163,840; no AttnRes. bf16
    weights, fp32 conv weights, A_log, dt_bias and correction bias, as the checkpoint holds them."""
    from k3batch.bench.roofline import active_params

    cfg = get_flavor("kimi-linear")
    assert cfg.mla_layer_ids == (3, 7, 11, 15, 19, 23, 26) and len(cfg.kda_layer_ids) == 20
    D, V = 2304, 163_840
    kda_bf16 = (
        3 * 4096 * D  # q_proj, k_proj, v_proj
        + 128 * D + 4096 * 128  # f_a_proj, f_b_proj
        + 128 * D + 4096 * 128  # g_a_proj, g_b_proj
        + 32 * D  # b_proj
        + 128  # o_norm
        + D * 4096  # o_proj
    )
    kda_fp32 = 3 * 4096 * 4 + 32 + 4096  # q/k/v_conv1d [4096, 1, 4], A_log [32], dt_bias [4096]
    mla = (
        32 * 192 * D  # q_proj: 32 heads x (128 nope + 64 rope)
        + 576 * D  # kv_a_proj_with_mqa: 512 latent + 64 rope
        + 512  # kv_a_layernorm
        + 32 * 256 * 512  # kv_b_proj: 32 heads x (128 nope + 128 v)
        + D * 32 * 128  # o_proj
    )
    norms = 2 * D  # input_layernorm, post_attention_layernorm
    dense_ffn = 3 * 9216 * D
    router_bf16, router_fp32 = 256 * D, 256  # gate.weight, gate.e_score_correction_bias
    shared = 3 * 1024 * D
    expert = 3 * 1024 * D  # one routed expert: w1, w3 [1024, D], w2 [D, 1024]
    head = V * D  # lm_head; the embedding is the same size
    bf16 = 20 * kda_bf16 + 7 * mla + 27 * norms + dense_ffn + 26 * (router_bf16 + shared) + D + head
    fp32 = 20 * kda_fp32 + 26 * router_fp32
    assert bf16 + fp32 + head + 26 * 256 * expert == 49_122_681_728  # the "48B" of the model card

    # Prefill (MFU): 2 x the parameters a token meets, 8 of the 256 experts.
    assert active_params(cfg) == bf16 + fp32 + 26 * 8 * expert == 3_106_972_544

    # Decode: 4 sequences, 20 distinct experts chosen in every MoE layer.
    with torch.device("meta"):
        model = K3Model(cfg, dtype=torch.bfloat16)
    ctx = [100, 200, 300, 400]
    B, tokens = len(ctx), sum(n + 1 for n in ctx)  # each cached token plus the new one
    moe = dict.fromkeys(range(1, 27), 20)
    floor = decode_floor(model, context_lens=ctx, experts_selected=moe)
    assert floor.bytes == {
        "dense": 2 * bf16 + 4 * fp32 + B * D * 2,  # B embedding rows
        "experts": 26 * 20 * expert * 2,
        "kda": 2 * B * 20 * (32 * 128 * 128 * 4 + 3 * 4096 * 3 * 2),  # fp32 state, 3 convs of 3
        "mla": tokens * 7 * 576 * 2,
    }
    assert floor.flops == {
        "dense": 2 * B * (bf16 + fp32),
        "experts": 26 * 2 * B * 8 * expert,
        "kda": 0,
        "mla": tokens * 7 * 32 * 2 * (576 + 512),  # absorbed: scores over 576, values over 512
    }
    # MXFP4 experts: 4.25 bits a weight (a byte of scale per 32); the rest as in bf16.
    with torch.device("meta"):
        packed = K3Model(cfg, dtype=torch.bfloat16, expert_dtype="mxfp4")
    mx = decode_floor(packed, context_lens=ctx, experts_selected=moe)
    assert mx.bytes == floor.bytes | {"experts": 26 * 20 * (expert // 2 + expert // 32)}
    assert mx.flops == floor.flops
    # A pipeline stage (layers 1 to 4, MLA at 3) whose first parameter is an fp32 A_log still
    # counts its latents and conv states in bf16.
    with torch.device("meta"):
        stage = K3Model(cfg, dtype=torch.bfloat16, layer_range=(1, 5))
    part = decode_floor(stage, context_lens=ctx, experts_selected=moe)
    assert part.bytes["mla"] == tokens * 1 * 576 * 2
    assert part.bytes["kda"] == 2 * B * 3 * (32 * 128 * 128 * 4 + 3 * 4096 * 3 * 2)
