"""The output directory's lease (issue 11, defect 7): a second driver is refused naming the
holder; a stale lease is taken over; a holder whose lease was taken finds out. Fails on the old
code: there was no lease at all (two drivers deleted each other's temp files). A lease from
another host goes by its heartbeat only, never by a pid this host does not have (issue 53)."""

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from k3batch.io import LEASE_NAME, LeaseHeldError, OutputLease, ShardSink


def test_second_holder_is_refused_naming_the_first(tmp_path):
    sink = ShardSink(str(tmp_path / "out"))
    with OutputLease(sink, job="first-job", settle_s=0):
        held = json.loads((tmp_path / "out" / LEASE_NAME).read_text())
        assert held["job"] == "first-job" and held["heartbeat_at"] > 0
        with pytest.raises(LeaseHeldError, match="in use by job 'first-job'.*pid"):
            OutputLease(sink, job="second-job", settle_s=0).acquire()
    assert not (tmp_path / "out" / LEASE_NAME).exists()  # released
    with OutputLease(sink, job="second-job", settle_s=0):
        pass


def test_stale_lease_is_taken_over_and_the_old_holder_notices(tmp_path):
    sink = ShardSink(str(tmp_path / "out"))
    old = OutputLease(sink, job="old", heartbeat_s=0.05, stale_after_s=0.3, settle_s=0)
    old.acquire()
    old._stop.set()  # the old driver stalls: no more heartbeats
    old._thread.join()
    time.sleep(0.4)
    new = OutputLease(sink, job="new", heartbeat_s=0.05, stale_after_s=0.3, settle_s=0)
    new.acquire()
    assert json.loads((tmp_path / "out" / LEASE_NAME).read_text())["job"] == "new"
    old._stop.clear()
    old._beat_once()
    assert old.lost
    with pytest.raises(RuntimeError, match="lost the lease"):
        old.check()
    old.release()  # does not delete the new holder's lease
    assert json.loads((tmp_path / "out" / LEASE_NAME).read_text())["job"] == "new"
    new.release()


def test_heartbeat_keeps_a_live_lease_fresh(tmp_path):
    sink = ShardSink(str(tmp_path / "out"))
    with OutputLease(sink, job="j", heartbeat_s=0.05, stale_after_s=0.5, settle_s=0):
        first = json.loads((tmp_path / "out" / LEASE_NAME).read_text())["heartbeat_at"]
        time.sleep(0.7)  # longer than stale_after_s: only heartbeats keep it held
        now = json.loads((tmp_path / "out" / LEASE_NAME).read_text())["heartbeat_at"]
        assert now > first
        with pytest.raises(LeaseHeldError):
            OutputLease(sink, job="other", stale_after_s=0.5, heartbeat_s=0.05).acquire()


def test_lease_of_a_killed_driver_on_this_host_is_taken_at_once(tmp_path):
    """A rerun right after a SIGKILL need not wait for the lease to go stale: its holder ran on
    this host and its process is gone. (Fails with only the staleness rule: LeaseHeldError.)"""
    import subprocess
    import sys

    sink = ShardSink(str(tmp_path / "out"))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    killed = OutputLease(sink, job="killed", settle_s=0)
    killed.holder["pid"] = int(gone.stdout)
    killed.acquire()
    killed._stop.set()  # killed: the heartbeat stops, nothing is released, the lease is fresh
    with OutputLease(sink, job="rerun", settle_s=0) as rerun:
        held = json.loads((tmp_path / "out" / LEASE_NAME).read_text())
        assert held["token"] == rerun.holder["token"]


def _other_host_lease(sink, *, heartbeat_age_s: float) -> dict:
    """Write the lease as a driver on another host would: a host name that is not this one, a
    pid that no process here has (it is that host's pid), a heartbeat `heartbeat_age_s` old."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    pid = int(gone.stdout)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # no such process on this host
    beat = time.time() - heartbeat_age_s
    holder = {"job": "remote-job", "host": f"not-{socket.gethostname()}", "pid": pid,
              "token": "remote-token", "acquired_at": beat, "heartbeat_at": beat}  # fmt: skip
    sink.write_json(LEASE_NAME, holder)
    return holder


def test_fresh_lease_of_another_host_is_not_taken_for_a_missing_pid(tmp_path):
    """A live driver on another host has a pid this host does not know: only a heartbeat older
    than stale_after_s lets the lease go, never the pid. (Fails when "pid not alive here" counts
    as gone whatever the host: drop the host check in `_holder_is_gone` and the lease is taken.)"""
    sink = ShardSink(str(tmp_path / "out"))
    holder = _other_host_lease(sink, heartbeat_age_s=1.0)
    refusal = f"in use by job 'remote-job' (host {holder['host']}, pid {holder['pid']})"
    with pytest.raises(LeaseHeldError, match=re.escape(refusal)):
        OutputLease(sink, job="local", stale_after_s=60.0, settle_s=0).acquire()
    assert json.loads((tmp_path / "out" / LEASE_NAME).read_text()) == holder  # untouched


def test_stale_lease_of_another_host_is_taken_over(tmp_path):
    """The same remote lease with no heartbeat for longer than stale_after_s: taken over."""
    sink = ShardSink(str(tmp_path / "out"))
    _other_host_lease(sink, heartbeat_age_s=61.0)
    with OutputLease(sink, job="local", stale_after_s=60.0, settle_s=0) as lease:
        held = json.loads((tmp_path / "out" / LEASE_NAME).read_text())
        assert held["token"] == lease.holder["token"] and held["job"] == "local"
