"""A shard commit is atomic: a write that fails or is killed halfway leaves no shard under its
final name, nothing is counted as committed, and a rerun writes the unit exactly once.

Both tests fail on a sink that writes straight to the final name (make `ShardSink._commit` do
only `with self.fs.open_output_stream(final) as out: write_temp(out)`): the half-written file is
then counted as committed. The kill test also fails when only `tmp = final` is changed (the
failed write's cleanup then deletes the partial file, but a SIGKILL leaves it).
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from k3batch.io import sink as sink_mod
from k3batch.io.sink import ShardSink, shard_name


def _table(n: int = 50) -> pa.Table:
    return pa.table({"id": list(range(n)), "out": [f"text {i}" for i in range(n)]})


def _assert_nothing_committed(out) -> None:
    sink = ShardSink(str(out))
    assert sink.committed() == set()
    assert not (out / shard_name(0, 0)).exists()
    sink.cleanup_temp()
    assert [p.name for p in out.iterdir()] == []  # no temp file survives the cleanup


def _assert_rerun_writes_once(out) -> None:
    sink = ShardSink(str(out))
    sink.write(0, 0, _table())
    assert sink.committed() == {(0, 0)}
    assert sink.read_all().column("id").to_pylist() == list(range(50))  # once, not twice
    with pytest.raises(AssertionError, match="already committed"):
        sink.write(0, 0, _table())


def test_failed_write_commits_nothing(tmp_path, monkeypatch):
    def half_then_raise(table, out):
        out.write(b"PAR1" + b"\0" * 1000)  # some bytes of a Parquet file, then a failure
        raise OSError("disk full (injected)")

    monkeypatch.setattr(sink_mod.pq, "write_table", half_then_raise)
    sink = ShardSink(str(tmp_path))
    with pytest.raises(OSError, match="injected"):
        sink.write(0, 0, _table())
    monkeypatch.undo()
    _assert_nothing_committed(tmp_path)
    _assert_rerun_writes_once(tmp_path)


_KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    import pyarrow as pa
    from k3batch.io import sink as sink_mod

    def half_then_hang(table, out):
        out.write(b"PAR1" + b"\\0" * 1000)
        out.flush()
        open(sys.argv[2], "w").close()  # tell the parent the bytes are written
        time.sleep(600)

    sink_mod.pq.write_table = half_then_hang
    sink_mod.ShardSink(sys.argv[1]).write(0, 0, pa.table({"id": [1, 2, 3]}))
    """
)


def test_write_killed_midway_commits_nothing(tmp_path):
    out, flag = tmp_path / "out", tmp_path / "half-written"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(out), str(flag)])
    try:
        deadline = time.monotonic() + 60
        while not flag.exists():
            assert proc.poll() is None, "the writer exited before writing"
            assert time.monotonic() < deadline, "the writer never started writing"
            time.sleep(0.05)
        written = [p for p in out.iterdir() if p.stat().st_size > 0]
        assert written, "the half-written bytes are on disk somewhere"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    _assert_nothing_committed(out)
    _assert_rerun_writes_once(out)
    assert pq.read_table(out / shard_name(0, 0)).num_rows == 50
