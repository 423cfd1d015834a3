"""The capacity planner against the K3 blog's figures (spec sections 8, 9), kimi-linear on one
GPU, its errors, the CLI."""

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from k3batch.cli import main
from k3batch.driver.jobspec import load_job_spec
from k3batch.parallel.plan import (
    MXFP4_BYTES_PER_PARAM,
    GiB,
    checkpoint_config,
    make_plan,
    pool_bytes,
    weight_bytes,
)
from k3batch.parallel.search import (
    DEFAULT_MIN_REQUESTS,
    DEFAULT_SEARCH_CONTEXT,
    shortfall,
    smallest_layout,
    tp_sizes,
)

K3 = checkpoint_config("k3")
BLOG = {"tp_size": 8, "cache_bytes": 40 * GiB, "context_len": 1 << 20}  # the blog's assumptions


def test_k3_cache_bytes_per_gpu_at_tp8():
    plan = make_plan(K3, **BLOG)
    assert plan.mla_bytes_per_token == 27_648
    assert plan.kda_state_bytes == 54_263_808
    assert plan.kda_conv_bytes == 1_907_712  # 69 layers x 3 x 1536 channels x 3 x 2 B
    assert plan.kda_block_bytes == 54_263_808 + 1_907_712  # both already 256-aligned
    assert make_plan(K3, **BLOG, dcp_size=8).mla_bytes_per_token == 3_456


def test_k3_logical_capacity_matches_blog():
    no_dcp, dcp8 = make_plan(K3, **BLOG), make_plan(K3, **BLOG, dcp_size=8)
    # 40 GiB / (54,263,808 / 2^20 + 27,648) and 40 GiB / (... + 3,456)
    assert no_dcp.capacity_tokens == 1_550_543  # blog: ~1.5M
    assert dcp8.capacity_tokens == 12_244_222  # blog: ~12.2M
    assert dcp8.capacity_tokens_no_dcp == no_dcp.capacity_tokens
    assert 7.85 <= dcp8.dcp_gain <= 7.95  # not 8: the KDA block is not split by DCP
    # whole 1M-token requests, with conv states and page rounding: 11 per group with DCP8
    assert dcp8.pages_per_request == 2048 and dcp8.max_requests == 11
    assert no_dcp.max_requests == 1


def test_k3_weights_do_not_fit_on_h200_at_tp8():
    total = weight_bytes(K3)
    assert 1.55e12 < total < 1.57e12  # the checkpoint is ~1.56 TB with MXFP4 experts
    plan = make_plan(K3, tp_size=8)
    # replicated tensors (embedding, router, latent projections) put a rank above total / 8
    assert total / 8 < plan.decode_weight_bytes < total / 8 * 1.1
    assert not plan.fits and plan.pool_bytes is None and plan.capacity_tokens is None
    assert any("decode rank weights 207.1 GB" in p for p in plan.problems)
    text = str(plan)
    assert "DOES NOT FIT" in text and "pool: none" in text
    assert "27,648 B / token" in text and "54,263,808 B / request" in text
    assert "-" not in text.split("pool:")[1].split("\n")[0]  # no negative pool


def test_expert_bytes_follow_the_checkpoint_format():
    bf16 = dataclasses.replace(K3, experts_mxfp4=False)
    experts = 92 * 896 * 3 * 3072 * 3584  # routed-expert parameters
    assert weight_bytes(bf16) - weight_bytes(K3) == pytest.approx(
        experts * (2 - MXFP4_BYTES_PER_PARAM), abs=1
    )


def test_prefill_stage_weights_use_the_largest_stage():
    plan = make_plan(K3, pp_size=8, tp_size=8)
    assert plan.stage_layers[0] == (0, 12) and plan.stage_layers[-1] == (84, 93)
    stages = [weight_bytes(K3, layer_range=r) for r in plan.stage_layers]
    assert plan.prefill_weight_bytes == max(stages)
    assert sum(stages) == pytest.approx(weight_bytes(K3), abs=8)  # ceil per stage


def test_pool_bytes():
    assert pool_bytes(100, 0.5, 20, 10) == 20
    with pytest.raises(ValueError, match="short by 207"):
        pool_bytes(int(141e9), 0.9, 330_000_000_000, 4 * GiB)
    with pytest.raises(ValueError, match="memory_fraction = 1.5"):
        pool_bytes(100, 1.5, 0, 0)


_BAD = [
    ({"tp_size": 8, "dcp_size": 3}, "dcp_size = 3 must divide tp_size = 8"),
    ({"tp_size": 5}, "tp_size = 5 does not divide kda_num_heads = 96"),
    ({"memory_fraction": 0.0}, "memory_fraction = 0.0"),
    ({"memory_fraction": 1.2}, "memory_fraction = 1.2"),
    ({"pp_size": 94}, "pp_size = 94 must be in"),
    ({"pp_size": 0}, "pp_size = 0"),
    ({"gpu": "a100"}, "gpu = 'a100' unknown"),
    ({"page_size": 0}, "page_size = 0"),
    ({"context_len": 0}, "context_len = 0"),
    ({"cache_bytes": 0}, "cache_bytes = 0"),
    ({"reserve_bytes": -1}, "reserve_bytes = -1"),
]


@pytest.mark.parametrize(
    "kw,match",
    [pytest.param(kw, m, id="-".join(f"{k}{v}" for k, v in kw.items())) for kw, m in _BAD],
)
def test_bad_layouts_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        make_plan(K3, **kw)


def test_tiny_flavor_plan_fits():
    plan = make_plan(checkpoint_config("k3-debug"), pp_size=4, tp_size=2, dcp_size=2)
    assert plan.fits and plan.pool_source == "memory"
    assert plan.pool_bytes == int(141e9 * 0.9) - plan.decode_weight_bytes - 4 * GiB
    assert plan.max_requests >= 1 and plan.capacity_tokens > 0
    assert plan.expert_bytes_per_param == 2
    d = plan.as_dict()
    assert d["fits"] and d["capacity_tokens"] == plan.capacity_tokens
    assert "fits: yes" in plan.lines()


def test_cli_plan_reproduces_blog_numbers():
    runner = CliRunner()
    args = ["plan", "--flavor", "k3", "--tp", "8", "--cache-gib", "40"]
    out = runner.invoke(main, args + ["--dcp", "8"])
    assert out.exit_code == 0, out.output
    for figure in ("3,456 B / token", "54,263,808 B / request", "1,907,712 B conv"):
        assert figure in out.output
    assert "12,244,222 tokens (12.24M)" in out.output and "DCP gain 7.90x" in out.output
    assert "DOES NOT FIT" in out.output
    out = runner.invoke(main, args)
    assert "27,648 B / token" in out.output and "1,550,543 tokens" in out.output


def test_cli_plan_tiny_flavor_and_bad_layout():
    runner = CliRunner()
    out = runner.invoke(main, ["plan", "--flavor", "k3-debug", "--tp", "2", "--gpu", "h100"])
    assert out.exit_code == 0, out.output
    assert "fits: yes" in out.output
    out = runner.invoke(main, ["plan", "--flavor", "k3-debug", "--tp", "8"])  # > 2 KDA heads
    assert out.exit_code != 0 and "does not divide kda_num_heads = 2" in out.output


def test_cli_plan_reads_a_checkpoint_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(K3.to_hf()))  # with quantization_config
    out = CliRunner().invoke(main, ["plan", "--model", str(tmp_path), "--tp", "8"])
    assert out.exit_code == 0, out.output
    assert f"{make_plan(K3, tp_size=8).decode_weight_bytes:,} B" in out.output
    assert "routed experts 0.53125 B/param" in out.output


H200_JOB = Path(__file__).parents[2] / "jobs" / "k3_h200.toml"


@pytest.fixture(scope="module")
def k3_h200():
    return smallest_layout(K3, name="k3", gpu="h200")


def test_search_finds_the_smallest_h200_layout_for_k3(k3_h200):
    chosen = k3_h200.chosen
    assert (chosen.pp_size, chosen.tp_size, chosen.dcp_size) == (16, 16, 16)
    assert chosen.context_len == DEFAULT_SEARCH_CONTEXT == 131_072
    assert chosen.fits and chosen.max_requests >= DEFAULT_MIN_REQUESTS
    assert chosen.max_requests == 47 and not shortfall(chosen, DEFAULT_MIN_REQUESTS)
    assert tp_sizes(K3) == [1, 2, 4, 8, 16, 32] and k3_h200.pp_sizes == (1, 2, 4, 8, 16, 32)
    gpus = chosen.pp_size + chosen.tp_size
    smaller = [p for p in k3_h200.tried if p.pp_size + p.tp_size < gpus]
    # every layout of fewer GPUs was tried, and none holds the weights plus the workload
    assert len(smaller) == len([1 for pp in (1, 2, 4, 8, 16) for tp in (1, 2, 4, 8, 16)
                                if pp + tp < gpus])  # fmt: skip
    for p in smaller:
        assert shortfall(p, DEFAULT_MIN_REQUESTS), (p.pp_size, p.tp_size)
    assert k3_h200.tried[-1] is chosen  # the search stops at the first size that fits
    by_layout = {(p.pp_size, p.tp_size): shortfall(p, 32) for p in k3_h200.tried}
    assert by_layout[(8, 16)] == ["prefill stage 80.0 GB over"]
    assert by_layout[(16, 8)] == ["decode rank 84.5 GB over"]


def test_search_reports_a_short_cache_and_no_fit():
    search = smallest_layout(K3, gpu="h200", min_requests=48, max_pp=16, max_tp=16)
    assert search.chosen is None  # PP16 + TP16 holds 47 of 48
    last = search.tried[-1]
    assert (last.pp_size, last.tp_size) == (16, 16)
    assert shortfall(last, 48) == ["cache holds 47 of 48 requests (0.1 GB short)"]
    assert "no layout of up to 32 GPUs per replica fits" in str(search)
    with pytest.raises(ValueError, match="min_requests = 0"):
        smallest_layout(K3, min_requests=0)


def test_search_on_a_tiny_flavor_stops_at_one_gpu():
    tiny = checkpoint_config("k3-debug")  # 2 KDA heads: tp 1 or 2
    search = smallest_layout(tiny, gpu="h100", min_requests=1, context_len=1024)
    assert search.tp_sizes == (1, 2) and len(search.tried) == 1
    assert (search.chosen.pp_size, search.chosen.tp_size, search.chosen.dcp_size) == (1, 1, 1)
    assert search.chosen.is_single_device and search.chosen.num_gpus == 1
    assert "= 1 GPU per replica (a single-device engine;" in str(search)


def test_cli_plan_searches_without_a_layout(k3_h200):
    out = CliRunner().invoke(main, ["plan", "--flavor", "k3", "--gpu", "h200"])
    assert out.exit_code == 0, out.output
    text = out.output
    assert "gpus  pp  tp dcp prefill GB  decode GB requests  result" in text
    assert "-  single device 1,437.3 GB over\n" in text  # pp 1, tp 1: one GPU
    assert "decode rank 84.5 GB over" in text and "prefill stage 80.0 GB over" in text
    assert "smallest layout: pp 16, tp 16, dcp 16 = 32 GPUs per replica" in text
    assert "47 requests of 131,072 tokens (>= 32)" in text and "spans 2 nodes of 8" in text
    # then the chosen layout's full plan
    assert "plan: k3 on h200 (141 GB), pp 16, tp 16, dcp 16" in text and "fits: yes" in text
    assert text.count("DOES NOT FIT") == 0 and len(k3_h200.tried) + 4 < len(text.splitlines())


@pytest.mark.parametrize(
    "args, match",
    [
        (["--requests", "0"], "--requests = 0 must be >= 1"),
        (["--tp", "8", "--requests", "4"], "--requests sets the search's workload"),
        (["--cache-gib", "40"], "--cache-gib needs a layout"),
        (["--gpu", "a100"], "gpu = 'a100' unknown"),
        (["--context-len", "0"], "context_len = 0 must be >= 1"),
        (["--pp", "0"], "pp_size = 0 must be in"),
    ],
    ids=["requests0", "requests-with-layout", "cache-in-search", "gpu", "context0", "pp0"],
)
def test_cli_plan_bad_input(args, match):
    out = CliRunner().invoke(main, ["plan", *args])
    assert out.exit_code == 2 and match in out.output and "Traceback" not in out.output


def test_cli_plan_search_without_a_fit_fails():
    out = CliRunner().invoke(main, ["plan", "--gpu", "h100", "--requests", "1000000"])
    assert out.exit_code == 1 and "no layout fits" in out.output


def test_h200_job_is_the_planner_layout(k3_h200, tmp_path):
    spec = load_job_spec(H200_JOB)
    chosen, r, e = k3_h200.chosen, spec.replicas, spec.engine
    assert (r.pp, r.tp, r.dcp) == (chosen.pp_size, chosen.tp_size, chosen.dcp_size)
    assert r.accelerator_type == "H200" and r.device == "cuda"
    assert (e.memory_fraction, e.page_size) == (chosen.memory_fraction, chosen.page_size)
    assert (e.max_num_seqs, e.max_seq_len) == (k3_h200.min_requests, chosen.context_len)
    header = H200_JOB.read_text()
    assert "`k3batch plan --flavor k3 --gpu h200`" in header
    for figure in (chosen.prefill_weight_bytes, chosen.decode_weight_bytes, chosen.pool_bytes):
        assert f"{figure / 1e9:.1f} GB" in header
    assert f"{chosen.max_requests} requests of 131,072" in header
    # it validates against the real K3 config (TP/DCP sizes, PP split)
    (tmp_path / "config.json").write_text(json.dumps(K3.to_hf()))
    dataclasses.replace(spec, model=str(tmp_path)).validate()


# ---- kimi-linear on one GPU ------------------------------------------------------------------

KIMI_LINEAR = checkpoint_config("kimi-linear")  # bf16 experts, as the public checkpoint
ONE_GPU = {"pp_size": 1, "tp_size": 1, "context_len": 131_072}


def test_kimi_linear_fits_one_h200_in_bf16_and_one_h100_only_with_mxfp4():
    """49,122,681,728 parameters (tests/bench/test_roofline.py counts them by hand),
    47,110,422,528 of them in the 26 x 256 routed experts: 98.2 GB in bf16 exceed an H100's
    0.9 x 80 GB but leave 24.4 GB of an H200's 126.9 GB for the cache; MXFP4-packed experts
    (17/32 B a parameter) make 29.1 GB, which leave 38.7 GB of an H100. Per request: 20 KDA
    layers of fp32 state (32 x 128 x 128 x 4 B) and conv states; per token: 7 MLA layers of 576
    bf16 latents."""
    assert not KIMI_LINEAR.experts_mxfp4
    params, routed = 49_122_681_728, 26 * 256 * 3 * 1024 * 2304
    h200 = make_plan(KIMI_LINEAR, gpu="h200", **ONE_GPU)
    h100 = make_plan(KIMI_LINEAR, gpu="h100", **ONE_GPU)
    mxfp4 = checkpoint_config("kimi-linear", experts="mxfp4")
    h100_mx = make_plan(mxfp4, gpu="h100", **ONE_GPU)
    assert h200.is_single_device and h200.num_gpus == 1
    assert h200.decode_weight_bytes == h100.decode_weight_bytes == 2 * params
    assert h200.decode_expert_bytes == 2 * routed
    assert h100_mx.decode_weight_bytes == 2 * (params - routed) + routed * 17 // 32
    assert h100_mx.decode_expert_bytes == routed * 17 // 32
    # bf16: an H200 yes, an H100 no; MXFP4: an H100 yes
    assert h200.fits and h200.pool_bytes == int(141e9 * 0.9) - 2 * params - 4 * GiB
    assert not h100.fits and h100.pool_bytes is None
    assert h100.problems == ("single device weights 98.2 GB + reserve 4.3 GB > 0.9 x 80 GB = "
                             "72.0 GB of h100",)  # fmt: skip
    assert h100_mx.fits
    assert h100_mx.pool_bytes == int(80e9 * 0.9) - h100_mx.decode_weight_bytes - 4 * GiB
    # the cache: per request and per token, then what the pools hold
    for plan in (h200, h100_mx):
        assert plan.kda_state_bytes == 20 * 32 * 128 * 128 * 4
        assert plan.kda_conv_bytes == 20 * 3 * 4096 * 3 * 2
        assert plan.mla_bytes_per_token == 7 * 576 * 2
    assert round(h200.pool_bytes / 1e9, 1) == 24.4 and h200.max_requests == 22
    assert round(h100_mx.pool_bytes / 1e9, 1) == 38.7 and h100_mx.max_requests == 35
    assert h200.capacity_tokens == 2_905_494 and h100_mx.capacity_tokens == 4_610_341
    # the search chooses the one GPU where it holds the workload, and says why not elsewhere
    assert smallest_layout(KIMI_LINEAR, gpu="h200", min_requests=16).chosen.num_gpus == 1
    assert smallest_layout(mxfp4, gpu="h100", min_requests=16).chosen.num_gpus == 1
    on_h100 = smallest_layout(KIMI_LINEAR, gpu="h100", min_requests=16)
    assert shortfall(on_h100.tried[0], 16) == ["single device 30.5 GB over"]
    assert on_h100.chosen.num_gpus == 4


def test_cli_plan_kimi_linear_on_one_gpu():
    runner = CliRunner()
    args = ["plan", "--flavor", "kimi-linear", "--tp", "1", "--context-len", "131072"]
    out = runner.invoke(main, args + ["--gpu", "h200"])
    assert out.exit_code == 0, out.output
    assert "pp 1, tp 1, dcp 1 (one GPU: a single-device engine prefills and decodes)" in out.output
    assert "of which routed experts (bf16): 94,220,845,056 B" in out.output
    assert "pool: 24,359,669,248 B (24.4 GB" in out.output and "fits: yes" in out.output
    out = runner.invoke(main, args + ["--gpu", "h100"])
    assert "DOES NOT FIT: single device weights 98.2 GB" in out.output
    out = runner.invoke(main, args + ["--gpu", "h100", "--experts", "mxfp4"])
    assert "routed experts (MXFP4): 25,027,411,968 B" in out.output and "fits: yes" in out.output
    assert "8,064 B / token" in out.output and "41,943,040 B / request" in out.output


def test_kimi_linear_h200_job_is_one_gpu_per_replica_as_planned(tmp_path):
    """jobs/kimi_linear_h200.toml: single-device replicas on H200s, the planner's figures for
    its max_seq_len in its header, and it validates against the public config."""
    job = Path(__file__).parents[2] / "jobs" / "kimi_linear_h200.toml"
    spec = load_job_spec(job)
    r, e = spec.replicas, spec.engine
    assert (r.pp, r.tp, r.dcp, r.disaggregate) == (1, 1, 1, False)
    assert r.accelerator_type == "H200" and r.device == "cuda"
    plan = make_plan(KIMI_LINEAR, gpu="h200", pp_size=1, tp_size=1, dcp_size=1,
                     context_len=e.max_seq_len, memory_fraction=e.memory_fraction)  # fmt: skip
    assert plan.fits and plan.is_single_device
    header = job.read_text()
    for figure in (plan.decode_weight_bytes, plan.pool_bytes):
        assert f"{figure / 1e9:.1f} GB" in header
    assert f"{plan.max_requests} requests of {e.max_seq_len:,}" in header
    (tmp_path / "config.json").write_text(json.dumps(KIMI_LINEAR.to_hf()))
    dataclasses.replace(spec, model=str(tmp_path)).validate()
