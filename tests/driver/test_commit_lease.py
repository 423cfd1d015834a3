"""A driver that lost its output lease writes no further shard: `Committer.maybe_commit` checks
the lease before the shard's write and rename, never after (issue 53).

Fails when the check moves after `self.sink.write(...)` in `maybe_commit`: the shard of the unit
is then committed into the directory another driver holds before the error is raised.
"""

import json

import pyarrow as pa
import pytest

from k3batch.driver.commit import Committer
from k3batch.driver.intake import OpenUnit
from k3batch.io import LEASE_NAME, OutputLease, ShardSink, shard_name
from k3batch.driver.jobspec import JobSpec, OutputSpec
from k3batch.driver.report import JobReport


def _finished_unit(key: tuple[int, int], n: int = 3) -> OpenUnit:
    rows = [{"generated_text": f"out {i}", "output_token_ids": [i], "finish_reason": "length",
             "num_prompt_tokens": 2, "num_output_tokens": 1, "error": None}
            for i in range(n)]  # fmt: skip
    return OpenUnit(key=key, table=pa.table({"prompt": [f"p{i}" for i in range(n)]}),
                    ids=[f"in:{i}" for i in range(n)], results=rows, remaining=0)  # fmt: skip


def test_no_shard_is_written_after_the_lease_is_lost(tmp_path):
    out = tmp_path / "out"
    sink = ShardSink(str(out))
    spec = JobSpec(output=OutputSpec(path=str(out)))
    with OutputLease(sink, job="first", settle_s=0) as lease:
        commit = Committer(spec, sink, True, JobReport(job="first", output=str(out)), lease)
        assert commit.maybe_commit(_finished_unit((0, 0)))  # held: the shard is written
        assert sink.committed() == {(0, 0)}

        # Another driver takes the directory over (it found this lease stale); the next
        # heartbeat finds a foreign token and marks the lease lost.
        taker = {"job": "second", "host": "h", "pid": 1, "token": "second-token",
                 "acquired_at": 0.0, "heartbeat_at": 0.0}  # fmt: skip
        sink.write_json(LEASE_NAME, taker)
        assert lease._beat_once() is False and lease.lost

        with pytest.raises(RuntimeError, match="lost the lease"):
            commit.maybe_commit(_finished_unit((0, 1)))
    assert sink.committed() == {(0, 0)}
    assert not (out / shard_name(0, 1)).exists()
    assert sorted(p.name for p in out.iterdir()) == sorted([shard_name(0, 0), LEASE_NAME])
    assert json.loads((out / LEASE_NAME).read_text())["token"] == "second-token"
