"""`k3batch plan --estimate` (k3batch/sim/estimate.py) on a calibration measured here on the CPU
(k3-debug): refusals agree with `plan`, the job's length extrapolates a full run's, and the
command prints the table."""

import subprocess
import sys

import pytest
from click.testing import CliRunner

from k3batch.cli import main
from k3batch.engine.config import EngineConfig
from k3batch.model import get_flavor
from k3batch.parallel.plan import checkpoint_config, make_plan
from k3batch.sim.calibration import Calibration
from k3batch.sim.cluster import cluster_from
from k3batch.sim.estimate import estimate_job, estimate_layout, run_replica
from k3batch.sim.workload import Workload

ENGINE = EngineConfig(chunk_size=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    path = tmp_path_factory.mktemp("cal") / "cpu.jsonl"
    subprocess.run([sys.executable, "-m", "k3batch.cli", "bench", "calibrate", "--flavor",
                    "k3-debug", "--device", "cpu", "--out", str(path)], check=True,
                   env={"OMP_NUM_THREADS": "1", "PATH": ""}, capture_output=True)  # fmt: skip
    return path


def test_a_layout_that_does_not_fit_is_refused_as_plan_refuses_it(table):
    config = checkpoint_config("k3")
    cluster = cluster_from("h100x8")
    est = estimate_job(config, "k3", cluster, Workload.fixed(1000, 8192, 1024),
                       calibration=Calibration.load(table), engine_config=ENGINE,
                       layouts=[(1, 1, 1), (1, 8, 8)])  # fmt: skip
    for row in est.rows:
        plan = make_plan(config, gpu="h100", pp_size=row.pp, tp_size=row.tp, dcp_size=row.dcp,
                         context_len=8192 + 1024 + 1, page_size=ENGINE.page_size)  # fmt: skip
        assert not plan.fits and not row.fits
        assert row.why == "; ".join(plan.problems)
    assert est.best is None
    assert "refused: single device weights" in str(est)


def synthetic(config) -> Calibration:
    """A fixed table for `config` at tp 1 (the measured one varies from run to run): every part
    costs 0.02 ms + 1 us a token (+ 10 ns an attended key for mla)."""
    from k3batch.sim.calibration import PARTS, Point, experts_key

    points = []
    for part in PARTS:
        for phase, grid in (("prefill", (16, 256, 4096)), ("decode", (1, 16, 256))):
            for tokens in grid:
                for context in ((0, 4096) if part == "mla" else (0,)):
                    ms = 0.02 + 1e-3 * tokens + (1e-5 * tokens * context if part == "mla" else 0)
                    points.append(Point(part, phase, 1, 1, tokens, tokens if phase == "decode"
                                        else 1, context, ms, 1e9 * tokens, 1e6,
                                        experts_key(config, "bf16") if part == "moe" else ""))
    return Calibration(gpu="synthetic", peak_flops=1e15, peak_bytes_per_s=1e12, points=points)


def test_the_job_length_extrapolates_a_full_run():
    """Two runs of n and 2n requests predict the time of 3n within 5% of running all 3n."""
    config, cluster = get_flavor("k3-debug"), cluster_from("h200x8")
    cal = synthetic(config)
    plan = make_plan(config, gpu="h200", pp_size=1, tp_size=1, dcp_size=1, context_len=200,
                     page_size=ENGINE.page_size)  # fmt: skip
    work = Workload(num_prompts=96, prompt_lens=(40, 130, 70), output_lens=(9, 17, 5),
                    source="mixed")  # fmt: skip
    row = estimate_layout(config, plan, cal, cluster_from("h200x1"), work,
                          engine_config=ENGINE, sample=32)  # fmt: skip
    timed, _, _ = run_replica(config, plan, cal, cluster, work, 96, engine_config=ENGINE)
    full = max(t.finish_s for t in timed)
    assert row.job_s == pytest.approx(full, rel=0.05)
    tokens = sum(len(t.result.output_token_ids) for t in timed)
    assert tokens == work.total_output_tokens()
    assert row.output_tok_s_per_gpu == pytest.approx(tokens / row.job_s)


def test_plan_estimate_prints_every_layout_and_the_fastest(table):
    out = CliRunner().invoke(main, [
        "plan", "--estimate", "--flavor", "k3-debug", "--calibration", str(table), "--cluster",
        "h200x4", "--num-prompts", "2000", "--input-len", "100", "--output-len", "8",
        "--max-num-seqs", "8", "--chunk-size", "64"])  # fmt: skip
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert any(line.startswith("1 GPU") and "<- fastest" in line for line in lines) or any(
        "<- fastest" in line for line in lines)
    for name in ("1 GPU", "pp1+tp2", "pp2+tp2/dcp2"):
        assert any(line.startswith(name) for line in lines), name
    assert "cluster: 1 node x 4 h200" in out.output


def test_plan_estimate_names_a_missing_calibration(tmp_path):
    out = CliRunner().invoke(main, ["plan", "--estimate", "--flavor", "k3-debug",
                                    "--calibration", str(tmp_path / "none.jsonl")])  # fmt: skip
    assert out.exit_code == 2 and "none.jsonl" in out.output


def test_a_jobs_own_input_is_the_workload(tmp_path, mini_model_dir, table):
    """--job: the rows' prompts tokenized as the job does, their max_new_tokens, bad rows
    counted apart; the estimate runs on them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from k3batch.driver.jobspec import load_job_spec
    from k3batch.sim.workload import workload_from_job

    ids = [[5] * 30, [6] * 70, None, [7] * 50, [10**9]]  # a null prompt, an id off the vocab
    pq.write_table(pa.table({"prompt_token_ids": ids,
                             "max_new_tokens": [4, 9, 3, None, 2]}), tmp_path / "in.parquet")  # fmt: skip
    spec = tmp_path / "job.toml"
    spec.write_text(f'model = "{mini_model_dir}"\n[input]\npath = "{tmp_path}/in.parquet"\n'
                    f'[output]\npath = "{tmp_path}/out"\n[sampling]\nmax_new_tokens = 6\n'
                    "[engine]\nmax_num_seqs = 4\nmax_seq_len = 256\nchunk_size = 64\n")  # fmt: skip
    work = workload_from_job(load_job_spec(spec))
    assert work.num_prompts == 5 and work.bad_rows == 2
    assert work.prompt_lens == (30, 70, 50) and work.output_lens == (4, 9, 6)
    out = CliRunner().invoke(main, ["plan", "--estimate", "--job", str(spec), "--calibration",
                                    str(table), "--cluster", "h200x1"])  # fmt: skip
    assert f"{tmp_path}/in.parquet: 5 rows" in out.output, out.output
    assert "1 GPU" in out.output
