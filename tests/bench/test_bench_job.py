"""`k3batch bench job` on CPU: a tiny random-token workload through the job and the engine
alone; every prompt answered with its fixed number of tokens, the report's numbers filled; and
on a simulated GPU (`bench.sim_device`), with the steps' accounts of both sides."""

import gc
import json

import pyarrow.parquet as pq
import pytest

from k3batch.bench.job import format_job_bench, run_job_bench, write_random_prompts
from k3batch.bench.sim_device import SimDevice


def test_random_prompts_have_fixed_lengths_in_the_vocabulary(tmp_path):
    prompts = write_random_prompts(tmp_path / "p.parquet", 5, 7, vocab=50, seed=1)
    table = pq.read_table(tmp_path / "p.parquet")
    assert table.column("id").to_pylist() == ["0", "1", "2", "3", "4"]
    assert table.column("prompt_token_ids").to_pylist() == prompts
    assert all(len(p) == 7 and all(1 <= t < 50 for t in p) for p in prompts)


def test_job_bench_against_the_engine(cluster, mini_model_dir, tmp_path):
    row = run_job_bench("ignored", tmp_path, num_prompts=4, input_len=8, output_len=3,
                        device="cpu", model_dir=mini_model_dir, max_num_seqs=4,
                        chunk_size=4)  # fmt: skip
    json.dumps(row)  # a JSON line
    assert row["output_tokens"] == 4 * 3 and row["chunk_size"] == 4
    assert row["job_rows_per_s"] > 0 and row["job_output_tokens_per_s"] > 0
    assert 0 <= row["job_startup_s"] < row["job_wall_s"]
    assert row["engine_output_tokens_per_s"] > 0 and row["job_vs_engine"] > 0
    assert gc.get_freeze_count() == 0  # the engine alone's frozen objects thawed: our process
    out = [p for p in tmp_path.glob("out-*/**/*.parquet")]
    rows = sum(pq.read_metadata(p).num_rows for p in out)
    assert rows == 4, out


def test_sim_parses_its_times_and_arena():
    assert SimDevice.parse("sim") == SimDevice()
    sim = SimDevice.parse("sim:10,200")
    assert (sim.decode_s, sim.prefill_s, sim.arena_bytes) == (0.01, 0.2, SimDevice().arena_bytes)
    assert SimDevice.parse("sim:1,2,0.5").arena_bytes == 2**29
    with pytest.raises(ValueError, match="at most"):
        SimDevice.parse("sim:1,2,3,4")


def test_job_bench_on_a_simulated_device_accounts_for_both_engines(cluster, tmp_path):
    """The job and the engine alone on a simulated GPU (1 ms a decode step): the same steps on
    both sides, every decode step full, and where the job's window went."""
    row = run_job_bench("kimi-linear-debug", tmp_path, num_prompts=8, input_len=8,
                        output_len=3, device="sim:1,1,0.01", max_num_seqs=4)  # fmt: skip
    assert row["output_tokens"] == 8 * 3 and row["max_num_seqs"] == 4
    (job,), alone = row["job_engine"], row["engine_steps"]
    assert job["steps"] == alone["steps"] and job["steps"]["prefill"] == 2  # two waves of 4
    for a in (job, alone):
        assert a["mean_decode_batch"] == 4.0 and a["room_steps"] == 0
        assert 0 <= a["first_step_s"] and 0 <= a["tail_s"]
    assert job["first_step_s"] + job["tail_s"] < row["job_wall_s"]
    assert "replica 0 engine: first step" in format_job_bench(row)
