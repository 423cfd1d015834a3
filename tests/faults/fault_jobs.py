"""Job specs and job processes shared by the fault tests. Not a test module."""

import subprocess
import sys
from pathlib import Path


def write_job(tmp: Path, model_dir: str, inp: Path, name: str, *, pp: int = 2, tp: int = 2,
              max_retries: int = 10, wait_timeout_s: float = 600.0) -> Path:  # fmt: skip
    """A k3-debug CPU job over `inp` (greedy, 6 new tokens, units of 2 rows, 2 rows in flight
    per replica, one sequence at a time) writing to tmp/name; returns the spec's path."""
    job = tmp / f"{name}.toml"
    job.write_text(f"""
name = "{name}"
model = "{model_dir}"
[input]
path = "{inp}"
batch_rows = 2
[output]
path = "{tmp / name}"
[sampling]
temperature = 0.0
max_new_tokens = 6
[replicas]
device = "cpu"
pp = {pp}
tp = {tp}
max_inflight_rows = 2
max_retries = {max_retries}
wait_timeout_s = {wait_timeout_s}
[engine]
max_num_seqs = 1
max_seq_len = 128
chunk_size = 16
""")
    return job


def start_job(job: Path, address: str) -> subprocess.Popen:
    """`k3batch run job` in a subprocess against the Ray cluster at `address`; its output is
    appended to the spec's path with suffix .log."""
    cmd = [sys.executable, "-m", "k3batch.cli", "run", str(job), "--address", address]
    log = open(job.with_suffix(".log"), "a")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
