"""sim.validate on the CPU: the records in benchmarks/ parse; the benchmarks' procedures replayed
on the virtual clock (`sim.replay`) predict every row from a CPU table of k3-debug (its times
mean nothing here: the code runs); `bench engine`'s prefill time on the simulated engine is the
sum of the forwards the clock recorded; `Calibration.merge` keeps each key from one table."""

import math

import pytest
from click.testing import CliRunner

from k3batch.bench.calibrate import CalibrateSpec, run_calibration
from k3batch.bench.layouts import LayoutBench
from k3batch.model import get_flavor
from k3batch.sim import comm, records
from k3batch.sim.calibration import Calibration, Point
from k3batch.sim.checks import engine_checks, fill_checks, job_checks, layout_checks, pd_checks
from k3batch.sim.cluster import cluster_from
from k3batch.sim.replay import (
    sim_decode_step,
    sim_engine,
    sim_handoff,
    sim_pp_prefill,
    sim_tp_prefill,
)
from k3batch.sim.validate import format_checks, main

DEBUG = get_flavor("k3-debug")
ONE, TWO = cluster_from("h200x1"), cluster_from("h200x2")


@pytest.fixture(scope="module")
def table_path(tmp_path_factory):
    """k3-debug on the CPU at CPU_SHAPES (tp 1 and 2, dcp 1 and 2, bf16 and MXFP4 experts)."""
    path = tmp_path_factory.mktemp("cal") / "calibration_cpu.jsonl"
    spec = CalibrateSpec.for_device("cpu", flavor="k3-debug", repeats=1)
    run_calibration(spec, path, command="test", commit="abc123", log=lambda _: None)
    return path


@pytest.fixture(scope="module")
def table(table_path):
    return Calibration.load(table_path)


def _key(row: dict) -> tuple:
    return (row["batch"], row["prompt_len"], row["new_tokens"], row["chunk_size"],
            records.expert_dtype(row))  # fmt: skip


def test_records_parse_the_real_files():
    all_rows = records.read_jsonl(records.BENCH / "engine_k3slice_h200.jsonl")
    rows = records.engine_rows()
    assert rows and len({_key(r) for r in rows}) == len(rows)
    for row in rows:  # the latest of its key, of the default MoE GEMM
        assert row["flavor"] == "k3-slice" and row.get("moe_gemm", "auto") == "auto"
        later = all_rows[all_rows.index(row) + 1 :]
        default = [r for r in later if r.get("moe_gemm", "auto") == "auto"]
        assert _key(row) not in {_key(r) for r in default}
    job = records.job_row()
    assert (job["flavor"], job["num_prompts"], job["input_len"], job["output_len"]) == (
        "k3-slice", 1024, 1024, 256)  # fmt: skip
    assert job["sizing"]["max_num_seqs"] >= 1 and job["sizing"]["arena_bytes"]
    text = (records.BENCH / "pd_h200x2.txt").read_text()
    (handoff,) = [h for h in records.pd_handoffs() if h["flavor"] == "k3-slice"]
    assert handoff["input_len"] == 1024 and "--disaggregate" in handoff["command"]
    assert f"{handoff['bytes']:,} B, {handoff['ms']:.2f} ms, {handoff['gb_per_s']:.2f} GB/s" in text
    fill = records.fill_record()
    assert fill["stages"] == 8 and [r["chunks"] for r in fill["rows"]] == sorted(
        r["chunks"] for r in fill["rows"])  # fmt: skip
    assert records.host_row()["decode_host_ms_per_step"] > 0
    layouts = records.read_jsonl(records.BENCH / "layouts_k3slice_h200x2.jsonl")
    for row in (r for r in layouts if r["phase"] == "prefill"):  # LayoutBench's prompt_len
        assert row["tokens_per_s"] * row["wall_s"] == pytest.approx(LayoutBench().prompt_len,
                                                                    rel=1e-3)  # fmt: skip


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_engine_procedure_prefill_time_is_the_sum_of_the_forwards(table, overlap):
    sim = sim_engine(DEBUG, table, ONE, batch=4, prompt_len=100, new_tokens=5, chunk_size=32,
                     experts="8x2 bf16", overlap=overlap)  # fmt: skip
    assert len(sim["prefill_runs"]) == 3
    for seconds, forwards, steps in sim["prefill_runs"]:
        assert seconds == pytest.approx(forwards, rel=1e-12) and seconds > 0
        assert steps >= math.ceil(100 / 32)
    median = sorted(r[0] for r in sim["prefill_runs"])[1]
    assert sim["prefill_tok_s"] == pytest.approx(400 / median)
    assert sim["decode_step_ms"] > 0 and sim["max_num_seqs"] == 4


def test_replays_predict_from_the_table(table):
    pp = sim_pp_prefill(DEBUG, table, TWO, num_stages=2, prompt_len=256, chunk_size=64)
    free = sim_pp_prefill(DEBUG, table, TWO, num_stages=2, prompt_len=256, chunk_size=64,
                          links=False)  # fmt: skip
    assert pp["seconds"] > free["seconds"] > 0 and pp["stream_s_per_chunk"] > 0
    assert 0 < pp["fill"] <= 1 and len(pp["busy"]) == 2
    tp = sim_tp_prefill(DEBUG, table, TWO, tp=2, prompt_len=256, chunk_size=64)
    assert tp["seconds"] > tp["comm_s"] > 0
    dec = sim_decode_step(DEBUG, table, TWO, tp=2, dcp=2, batch=4, context_len=128, steps=3)
    assert dec["seconds"] > dec["comm_s"] > 0
    slice_ = get_flavor("k3-slice")
    h = sim_handoff(slice_, TWO, num_tokens=1024)
    assert h["bytes"] == comm.handoff_bytes(slice_, 1024, range(slice_.num_hidden_layers))
    assert h["seconds"] == pytest.approx(comm.p2p_s(h["bytes"], TWO.intra))


def test_every_group_gives_predictions(table):
    small = [r for r in records.engine_rows() if r["batch"] * r["prompt_len"] <= 2048][:2]
    job = records.job_row() | {"num_prompts": 12, "output_len": 4}
    checks = [*engine_checks(DEBUG, table, ONE, rows=small),
              *job_checks(DEBUG, table, ONE, row=job),
              *layout_checks(DEBUG, table, TWO),
              *pd_checks(get_flavor("k3-slice"), TWO),
              *fill_checks(table)]  # fmt: skip
    groups = {c.group for c in checks}
    assert groups == {"engine", "job", "layouts", "pd", "fill"}
    assert len([c for c in checks if c.group == "engine"]) == 4
    assert len([c for c in checks if c.group == "layouts"]) == 8
    for c in checks:
        assert c.predicted is not None and c.predicted > 0, c
        assert c.verdict in ("PASS", "MISS"), c
        assert (c.verdict == "MISS") == bool(c.why), c
    (nbytes,) = [c for c in checks if c.what.endswith(": bytes")]
    assert nbytes.verdict == "PASS" and nbytes.tolerance == 0
    text = "\n".join(format_checks(checks))
    assert "tally: PASS" in text and "## 3. CPU: the fill" in text


def test_missing_points_are_no_prediction(table):
    no_dcp = Calibration(gpu=table.gpu, peak_flops=table.peak_flops,
                         peak_bytes_per_s=table.peak_bytes_per_s,
                         points=[p for p in table.points if p.dcp == 1])  # fmt: skip
    checks = layout_checks(DEBUG, no_dcp, TWO)
    (dcp,) = [c for c in checks if "dcp2" in c.what]
    assert dcp.verdict == "N/A" and "dcp 2" in dcp.why
    assert all(c.predicted is not None for c in checks if c is not dcp)


def _point(part: str, ms: float, tp: int = 1) -> Point:
    return Point(part, "prefill", tp, 1, 1024, 1, 0, ms, 1e12, 1e9)


def _table(points, gpu="NVIDIA H200", flavor="k3", peak=777e12) -> Calibration:
    return Calibration(gpu=gpu, peak_flops=peak, peak_bytes_per_s=4.26e12, points=points,
                       header={"flavor": flavor})  # fmt: skip


def test_merge_takes_each_key_from_the_last_table_that_has_it():
    k3 = _table([_point("kda", 1.0), _point("head", 2.0), _point("head", 3.0, tp=2),
                 Point("head", "prefill", 1, 1, 2048, 1, 0, 4.0, 1, 1)])  # fmt: skip
    sliced = _table([_point("head", 5.0)], flavor="k3-slice")
    merged = Calibration.merge([k3, sliced])
    got = sorted((p.part, p.tp, p.tokens, p.ms) for p in merged.points)
    # head at tp 1 is k3-slice's alone (k3's 2,048-token point is dropped), tp 2 stays k3's
    assert got == [("head", 1, 1024, 5.0), ("head", 2, 1024, 3.0), ("kda", 1, 1024, 1.0)]
    assert merged.header == k3.header and "k3, k3-slice" in merged.source
    with pytest.raises(ValueError, match="gpu"):
        Calibration.merge([k3, _table([], gpu="NVIDIA H100")])
    with pytest.raises(ValueError, match="peak_flops"):
        Calibration.merge([k3, _table([], peak=989e12)])


def test_command_prints_and_writes_the_table(table_path, tmp_path):
    out = tmp_path / "validation.txt"
    res = CliRunner().invoke(main, ["--only", "pd,fill", "--cpu-calibration", str(table_path),
                                    "--out", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert "# command: python -m k3batch.sim.validate" in text
    assert "calibration " + str(table_path) + ": cpu, flavor k3-debug" in text
    assert "cluster (layouts, pd rows): cluster: 1 node x 2 h200" in text
    assert "## 2. two H200s (one node): the 1+1 handoff" in text and "P1 " in text
    assert "F11 " in text and "tally: " in text
    # a GPU table of another flavor's experts: rows it cannot predict say so, nothing fails
    res = CliRunner().invoke(main, ["--only", "layouts", "--calibration", str(table_path)])
    assert res.exit_code == 0, res.output
    assert "N/A L1: no prediction: no calibration points for part 'moe'" in res.output
    res = CliRunner().invoke(main, ["--only", "layouts", "--calibration", str(tmp_path / "x")])
    assert res.exit_code != 0 and "does not exist" in res.output
    res = CliRunner().invoke(main, ["--only", "bogus"])
    assert res.exit_code != 0 and "'bogus'" in res.output
