"""`k3batch bench host` on a small schedule: every request runs to its end through the real
engine with the computing runner replaced, and the row counts its steps."""

import json

from click.testing import CliRunner

from k3batch.cli import main


def test_bench_host_replays_a_schedule(tmp_path):
    out = tmp_path / "host.jsonl"
    args = ["bench", "host", "--flavor", "k3-debug", "--num-prompts", "12", "--input-len", "40",
            "--output-len", "5", "--arena-gib", "0.003", "--json", str(out)]  # fmt: skip
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    row = json.loads(out.read_text())
    assert row["prefill_steps"] >= 1 and row["decode_steps"] >= 4
    assert 1 <= row["max_num_seqs"] < 12  # the arena's room, as on a GPU
    assert row["prefill_host_ms_per_step"] > 0 and row["decode_host_ms_per_step"] > 0
    # Full steps: 12 requests of 5 new tokens need at least 60 / max_num_seqs decode rows.
    assert row["decode_steps"] * row["max_num_seqs"] >= 12 * 4
