"""The calibration: `bench calibrate` on k3-debug on the CPU writes a table that loads and whose
points come back exactly; `part_s` interpolates as its docstring says (exact for costs that are
bilinear in tokens and attended keys); `on` keeps each point's efficiency; the counts equal a
hand count and `bench.roofline`'s decode count. The CPU times themselves mean nothing."""

import json
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from k3batch.bench.layer_parts import PartBench, part_case, probe_model
from k3batch.bench.roofline import decode_floor
from k3batch.cli import main
from k3batch.model import get_flavor
from k3batch.sim.calibration import PARTS, Calibration, Point

TOKENS = (1024, 2048, 4096)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    path = tmp_path_factory.mktemp("cal") / "calibration_cpu.jsonl"
    args = ["bench", "calibrate", "--flavor", "k3-debug", "--device", "cpu", "--repeats", "1",
            "--commit", "abc123", "--out", str(path)]  # fmt: skip
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 0, out.output
    return path


def test_calibrate_on_cpu_writes_a_loadable_table(table):
    rows = [json.loads(line) for line in table.read_text().splitlines()]
    header, end = rows[0], rows[-1]
    assert header["kind"] == "header" and header["gpu"] == "cpu" and header["commit"] == "abc123"
    assert header["command"].startswith("k3batch bench calibrate --flavor k3-debug")
    assert (header["peak_flops"], header["peak_bytes_per_s"]) == (777e12, 4.26e12)
    assert end["kind"] == "end" and end["notes"] == [] and end["points"] == len(rows) - 2
    cal = Calibration.load(table)
    keys = {(p.part, p.phase, p.tp, p.dcp, p.experts) for p in cal.points}
    for tp in (1, 2):
        for phase in ("prefill", "decode"):
            for part in PARTS:
                experts = ("8x2 bf16", "8x2 mxfp4") if part == "moe" else ("",)
                assert all((part, phase, tp, 1, e) in keys for e in experts), (part, phase, tp)
    assert ("mla", "decode", 2, 2, "") in keys  # a DCP rank of 2
    assert all(p.ms > 0 and p.bytes > 0 for p in cal.points)
    for p in cal.points:  # every measured point comes back
        s = cal.part_s(p.part, phase=p.phase, tp=p.tp, dcp=p.dcp, tokens=p.tokens, seqs=p.seqs,
                       context_tokens=p.seqs * p.context, experts=p.experts)  # fmt: skip
        assert s == pytest.approx(p.ms / 1e3, rel=1e-12), p


def _cal(points, peak_flops=1e12, peak_bytes_per_s=1e10):
    return Calibration(gpu="test", peak_flops=peak_flops, peak_bytes_per_s=peak_bytes_per_s,
                       points=points)  # fmt: skip


def _point(part, phase, tokens, seqs, context, ms, **kw):
    return Point(part, phase, kw.pop("tp", 1), kw.pop("dcp", 1), tokens, seqs, context, ms,
                 kw.pop("flops", 1.0), kw.pop("bytes", 1.0), **kw)  # fmt: skip


def test_part_s_interpolates_in_tokens_and_extends_beyond_the_grid():
    ms = {1024: 2.0, 2048: 3.0, 4096: 5.0}  # 1 ms + 1 ms per 1K tokens
    cal = _cal([_point("dense_ffn", "prefill", t, 1, 0, m) for t, m in ms.items()])

    def ms_at(tokens, seqs=1):
        s = cal.part_s("dense_ffn", phase="prefill", tp=1, dcp=1, tokens=tokens, seqs=seqs,
                       context_tokens=0)  # fmt: skip
        return 1e3 * s

    assert ms_at(2048) == 3.0 and ms_at(3072) == pytest.approx(4.0)
    assert ms_at(8192) == pytest.approx(9.0)  # the last two points' slope
    assert ms_at(512) == pytest.approx(1.5)  # the first two's line
    assert ms_at(2048, seqs=8) == 3.0  # one sequence count measured: the others read it
    steep = _cal([_point("kda", "prefill", t, 1, 0, m) for t, m in ((1024, 1.0), (2048, 4.0))])
    s = steep.part_s("kda", phase="prefill", tp=1, dcp=1, tokens=512, seqs=1, context_tokens=0)
    assert 1e3 * s == pytest.approx(0.5)  # the line gives -0.5: clamped to the proportional


def test_part_s_is_exact_for_attention_bilinear_in_tokens_and_keys():
    """MLA points from t = a + b T + c P (P attended pairs) at chunks of 1K and 2K after 0 or
    8K cached tokens, one sequence, and decode batches 1, 4, 16 at 1K and 8K: any shape inside
    the grid gets t back (the pairs are tokens x attended keys, bilinear)."""

    def t_ms(tokens, pairs):
        return 0.5 + 1e-3 * tokens + 2e-7 * pairs

    pts = []
    for T in (1024, 2048):
        for c in (0, 8192):
            pts.append(_point("mla", "prefill", T, 1, c, t_ms(T, T * c + T * (T + 1) / 2)))
    for B in (1, 4, 16):
        for c in (1024, 8192):
            pts.append(_point("mla", "decode", B, B, c, t_ms(B, B * (c + 1))))
    cal = _cal(pts)
    T, c = 1536, 4096
    s = cal.part_s("mla", phase="prefill", tp=1, dcp=1, tokens=T, seqs=1, context_tokens=c)
    assert 1e3 * s == pytest.approx(t_ms(T, T * c + T * (T + 1) / 2))
    B, c = 10, 3000
    s = cal.part_s("mla", phase="decode", tp=1, dcp=1, tokens=B, seqs=B, context_tokens=B * c)
    assert 1e3 * s == pytest.approx(t_ms(B, B * (c + 1)))


def test_on_keeps_efficiency_scaling_by_what_binds():
    # 1 TFLOP/s and 10 GB/s here: the first point is bound by its bytes (1 s against 0.1 s of
    # FLOPs), the second by its FLOPs (1 s against 0.1 s of bytes)
    memory = _point("kda", "decode", 1, 1, 0, 2000.0, flops=1e11, bytes=1e10)
    compute = _point("kda", "prefill", 1, 1, 0, 4000.0, flops=1e12, bytes=1e9)
    gpu = SimpleNamespace(name="faster", bf16_flops=3e12, hbm_bytes_per_s=2e10, source="given")
    there = _cal([memory, compute]).on(gpu)
    by_phase = {p.phase: p for p in there.points}
    assert by_phase["decode"].ms == pytest.approx(1000.0)  # bandwidth x2
    assert by_phase["prefill"].ms == pytest.approx(4000.0 / 3)  # FLOP/s x3
    assert there.gpu == "faster" and there.peak_flops == 3e12 and "scaled" in there.source
    # bound by its bytes here (1 s; FLOPs 0.5 s), by its FLOPs there (0.25 s; bytes 0.01 s)
    cal = _cal([_point("kda", "decode", 1, 1, 0, 1000.0, flops=5e11, bytes=1e10)])
    gpu = SimpleNamespace(name="x", bf16_flops=1e12 * 2, hbm_bytes_per_s=1e12)
    assert cal.on(gpu).points[0].ms == pytest.approx(250.0)


def test_a_missing_part_raises_naming_it():
    cal = _cal([_point("moe", "decode", 1, 1, 0, 1.0, tp=8, experts="896x16 mxfp4")])
    with pytest.raises(KeyError) as e:
        cal.part_s("moe", phase="decode", tp=8, dcp=1, tokens=4, seqs=4, context_tokens=0,
                   experts="896x16 bf16")  # fmt: skip
    assert "'moe'" in str(e.value) and "tp 8" in str(e.value) and "896x16 bf16" in str(e.value)
    with pytest.raises(KeyError, match="'head'"):
        cal.part_s("head", phase="prefill", tp=1, dcp=1, tokens=4, seqs=1, context_tokens=0)


def test_load_merges_runs_of_one_gpu(tmp_path):
    path = tmp_path / "t.jsonl"
    head = {"kind": "header", "gpu": "g", "peak_flops": 1.0, "peak_bytes_per_s": 1.0}
    rows = [head, _point("embed", "decode", 1, 1, 0, 1.0).row(), {"kind": "end"}, head,
            _point("embed", "decode", 1, 1, 0, 2.0).row()]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cal = Calibration.load(path)
    assert [p.ms for p in cal.points] == [2.0]  # the later run's point replaces the earlier
    path.write_text(path.read_text() + json.dumps(head | {"gpu": "other"}) + "\n")
    with pytest.raises(ValueError, match="gpu"):
        Calibration.load(path)


def test_dense_ffn_counts_equal_a_hand_count():
    """k3-debug (D 64, dense width 128), fp32 on the CPU, a rank of tp 2: 3 D I/2 weights plus
    the norm's D; 2 FLOPs per weight per token; the weights, the input and the output read or
    written once."""
    bench = PartBench(get_flavor("k3-debug"), torch.device("cpu"))
    case = part_case("dense_ffn", bench, probe_model(bench, 2), "prefill", 16, 1, 0, 2, 1)
    weights = 3 * 64 * 64 + 64
    assert case.flops == 2 * 16 * weights
    assert case.nbytes == 4 * weights + 2 * 16 * 64 * 4


def test_decode_counts_agree_with_the_roofline():
    """At tp 1 the KDA and MLA decode points count their caches, and MLA its attention FLOPs,
    as `bench.roofline.decode_floor` counts a decode step (over the probe's one KDA and one MLA
    layer); beside them the part's weights and its input and output."""
    bench = PartBench(get_flavor("k3-debug"), torch.device("cpu"))
    model = probe_model(bench, 1)
    B, ctx, D, a = 3, 40, 64, 4
    floor = decode_floor(model, context_lens=[ctx] * B, experts_selected={})
    io = 2 * B * D * a
    for part, layer, mixer in (("kda", "0", "self_attn"), ("mla", "1", "self_attn")):
        mods = (model.model.layers[layer].input_layernorm, getattr(model.model.layers[layer],
                                                                   mixer))  # fmt: skip
        W = sum(p.numel() for m in mods for p in m.parameters())
        case = part_case(part, bench, model, "decode", B, B, ctx, 1, 1)
        assert case.nbytes == W * a + io + floor.bytes[part], part
    mla = part_case("mla", bench, model, "decode", B, B, ctx, 1, 1)
    attn = model.model.layers["1"]
    W = sum(p.numel() for m in (attn.input_layernorm, attn.self_attn) for p in m.parameters())
    assert mla.flops == 2 * B * W + floor.flops["mla"]


def test_a_tables_peak_rates_are_its_gpus():
    """The efficiency of a point is taken against the measured GPU's rates: the H200's as
    measured here, an H100's datasheet derated as the H200's is, the H200's for an unknown."""
    from k3batch.bench.roofline import BF16_TFLOPS, COPY_TBPS, gpu_rates
    from k3batch.sim.cluster import GPUS, derated

    assert gpu_rates("NVIDIA H200") == pytest.approx((BF16_TFLOPS, COPY_TBPS))
    h100 = derated(GPUS["h100"])
    assert gpu_rates("NVIDIA H100 80GB HBM3") == (h100.bf16_flops / 1e12, h100.hbm_bytes_per_s / 1e12)
    assert h100.hbm_bytes_per_s < COPY_TBPS * 1e12
    assert gpu_rates("cpu") == (BF16_TFLOPS, COPY_TBPS)
