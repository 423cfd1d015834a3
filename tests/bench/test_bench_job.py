"""`k3batch bench job` on CPU: a tiny random-token workload through the job and the engine
alone; every prompt answered with its fixed number of tokens, the report's numbers filled."""

import json

import pyarrow.parquet as pq

from k3batch.bench.job import run_job_bench, write_random_prompts


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
    out = [p for p in tmp_path.glob("out-*/**/*.parquet")]
    rows = sum(pq.read_metadata(p).num_rows for p in out)
    assert rows == 4, out
