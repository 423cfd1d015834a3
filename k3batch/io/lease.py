"""The output directory's lease: one running job per directory.

A driver that writes to a directory holds `_k3batch_lease.json` there: its holder id (job name,
host, pid, a random token), when it took the lease and its last heartbeat (wall-clock seconds,
since two drivers may run on two machines). A background thread renews the heartbeat every
`heartbeat_s`. Another driver is refused while the heartbeat is fresher than `stale_after_s`,
with a message naming the holder; a stale lease (its driver was killed) is taken over, at once
when the holder ran on this host and its process is gone (a rerun right after a SIGKILL).
Taking over is write-then-read-back: of two drivers that race for a stale lease, the one whose
token is read back after a short settle wins, the other is refused. A holder that finds its
lease taken (it stalled past `stale_after_s`) sets `lost`; the driver stops writing then.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid

from k3batch.io.sink import ShardSink

LEASE_NAME = "_k3batch_lease.json"

_log = logging.getLogger(__name__)


class LeaseHeldError(ValueError):
    """The output directory is leased by another running job."""


class OutputLease:
    """Context manager: `with OutputLease(sink, job="name"):` holds the directory's lease."""

    def __init__(
        self,
        sink: ShardSink,
        *,
        job: str,
        heartbeat_s: float = 10.0,
        stale_after_s: float = 60.0,
        settle_s: float = 0.2,
    ):
        if not 0 < heartbeat_s < stale_after_s:
            raise ValueError(f"need 0 < heartbeat_s ({heartbeat_s}) < stale_after_s")
        self.sink, self.heartbeat_s, self.stale_after_s = sink, heartbeat_s, stale_after_s
        self.settle_s = settle_s
        self.holder = {
            "job": job,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "token": uuid.uuid4().hex,
        }
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lease or raise LeaseHeldError naming the holder."""
        current = self._read()
        if current is not None and current.get("token") != self.holder["token"]:
            age_s = time.time() - float(current.get("heartbeat_at", 0))
            if age_s < self.stale_after_s and not _holder_is_gone(current):
                raise LeaseHeldError(self._refusal(current, age_s))
            _log.warning(
                "taking over the stale lease of %s (last heartbeat %.0f s ago)",
                _who(current),
                age_s,
            )
        now = time.time()
        self._write(acquired_at=now, heartbeat_at=now)
        time.sleep(self.settle_s)  # a racing writer's rename lands within this
        back = self._read()
        if back is None or back.get("token") != self.holder["token"]:
            raise LeaseHeldError(self._refusal(back or {}, 0.0))
        self._acquired_at = now
        self._thread = threading.Thread(target=self._beat, daemon=True, name="output-lease")
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.heartbeat_s + 5)
            self._thread = None
        try:
            current = self._read()
            if current is not None and current.get("token") == self.holder["token"]:
                self.sink.fs.delete_file(f"{self.sink.path}/{LEASE_NAME}")
        except Exception as e:  # a lease left behind only delays the next job by stale_after_s
            _log.warning("could not release the output lease: %s", e)

    def check(self) -> None:
        """Raise RuntimeError if the lease was taken by another driver."""
        if self.lost:
            raise RuntimeError(
                f"lost the lease on {self.sink.uri!r} to another driver: stopped writing"
            )

    def __enter__(self) -> OutputLease:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s) and self._beat_once():
            pass

    def _beat_once(self) -> bool:
        """Renew the heartbeat; False (and `lost`) if another driver holds the lease now."""
        try:
            current = self._read()
            if current is None or current.get("token") != self.holder["token"]:
                self.lost = True
                _log.error("output lease taken by %s", _who(current or {}))
                return False
            self._write(acquired_at=self._acquired_at, heartbeat_at=time.time())
        except Exception as e:  # a missed beat is retried; stale only after stale_after_s
            _log.warning("output lease heartbeat failed: %s", e)
        return True

    def _read(self) -> dict | None:
        try:
            return self.sink.read_json(LEASE_NAME)
        except ValueError:  # torn or foreign content: treat as no lease
            return None

    def _write(self, **times: float) -> None:
        self.sink.write_json(LEASE_NAME, self.holder | times)

    def _refusal(self, current: dict, age_s: float) -> str:
        return (
            f"output dir {self.sink.uri!r} is in use by {_who(current)} (last heartbeat "
            f"{age_s:.0f} s ago; taken over once older than {self.stale_after_s:.0f} s): "
            f"wait for that job or choose another output dir"
        )


def _who(holder: dict) -> str:
    return (
        f"job {holder.get('job', '?')!r} (host {holder.get('host', '?')}, "
        f"pid {holder.get('pid', '?')})"
    )


def _holder_is_gone(holder: dict) -> bool:
    """True if the holder ran on this host and no process with its pid is alive."""
    if holder.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(holder.get("pid", 0)), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError):
        return False
    return False
