"""An autoscaling Ray cluster on one machine, for tests and the elastic benchmark.

Ray's fake multi-node provider (the one behind `ray.cluster_utils.AutoscalingCluster`) runs the
real autoscaler against node types that declare any resources (`GPU`, `accelerator_type:H200`)
and starts each "node" as a raylet on this machine: the scheduling, the placement groups and
the scale-up/scale-down decisions are Ray's own; only the devices are fake (a job runs its
model on CPU underneath). Unlike `AutoscalingCluster`, which runs `ray stop --force` (every Ray
process on the host, other users' too) and reads a config file the wheel does not ship, this
starts its head in a session of its own, with its own ports and temp dir, and `stop()` ends
exactly the processes of that session (`stop_session`, which the tests' shared Ray head uses
too, as it does `free_port`).

`multinode_cluster` is the tests' other multi-node cluster: Ray's `Cluster` (no autoscaler),
whose nodes the test adds and removes itself.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

STARTUP_TIMEOUT_S = 60.0


class SimulatedCluster:
    def __init__(self, worker_types: dict[str, dict], *, head_cpus: int = 1,
                 idle_timeout_s: float = 5.0):  # fmt: skip
        """worker_types: node type name -> {"resources": {...}, "max_workers": n}. The head
        has `head_cpus` CPUs and no GPU; worker nodes start at zero."""
        self.temp_dir = tempfile.mkdtemp(prefix="k3s", dir="/tmp")  # short: socket paths
        self.gcs_port = free_port()
        self.address = f"127.0.0.1:{self.gcs_port}"
        self.config = _config(worker_types, head_cpus, idle_timeout_s, self.address)
        self.proc: subprocess.Popen | None = None

    def start(self) -> str:
        """Start the head (with the autoscaler); returns the GCS address for `ray.init`."""
        config_path = Path(self.temp_dir) / "autoscaler.json"
        config_path.write_text(json.dumps(self.config))
        ray_cli = str(Path(sys.executable).with_name("ray"))
        env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
        # The head authenticates as this process's Ray client does (token mode with the same
        # token under the tests; else off, even where a local token file would turn it on).
        env.setdefault("RAY_AUTH_MODE", "disabled")
        env.pop("RAY_ADDRESS", None)
        head_cpus = self.config["available_node_types"]["ray.head.default"]["resources"]["CPU"]
        cmd = [
            ray_cli, "start", "--head", "--block", f"--port={self.gcs_port}",
            f"--num-cpus={head_cpus}",
            f"--autoscaling-config={config_path}", f"--temp-dir={self.temp_dir}",
            "--include-dashboard=false", "--disable-usage-stats",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
        ]  # fmt: skip
        log = open(Path(self.temp_dir) / "head.log", "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip
        self._wait_for_gcs()
        return self.address

    def _wait_for_gcs(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited: {self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.gcs_port), timeout=1):
                    pass
                time.sleep(2.0)  # the raylet registers shortly after the GCS listens
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"the head did not start in {STARTUP_TIMEOUT_S:g} s: {self.log_tail()}")

    def log_tail(self) -> str:
        path = Path(self.temp_dir) / "head.log"
        return path.read_text()[-3000:] if path.exists() else ""

    def stop(self) -> None:
        """End the head's session: the head, the autoscaler and every node it started (their
        processes stay in the head's session), then anything still naming our temp dir."""
        if self.proc is None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        else:
            stop_session(self.proc, self.temp_dir, grace_s=20)


def _config(worker_types: dict, head_cpus: int, idle_timeout_s: float, gcs_address: str) -> dict:
    """An autoscaler config for the fake multi-node provider (checked by Ray's schema)."""
    types = {
        name: {"resources": t["resources"], "node_config": {}, "min_workers": 0,
               "max_workers": t["max_workers"]}
        for name, t in worker_types.items()
    }  # fmt: skip
    types["ray.head.default"] = {"resources": {"CPU": head_cpus}, "node_config": {},
                                 "max_workers": 0}  # fmt: skip
    return {
        "cluster_name": "k3sim",
        "max_workers": sum(t["max_workers"] for t in worker_types.values()),
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": idle_timeout_s / 60,
        "provider": {
            "type": "fake_multinode",
            "gcs_address": gcs_address,
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "auth": {},
        "available_node_types": types,
        "head_node_type": "ray.head.default",
        "docker": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


@contextmanager
def multinode_cluster(head_cpus: int, *, dashboard: bool = False):
    """A `ray.cluster_utils.Cluster` head with head_cpus CPUs, on ports and a temp dir of its
    own (so that it never meets another test's cluster), removed with its temp dir on exit;
    dashboard: with the dashboard (the state API: `ray.util.state.list_actors`)."""
    import ray
    from ray.cluster_utils import Cluster

    # Cluster() writes the head's address into Ray's default temp dir, which it does not create
    # (a ray.init() without an address, here or in another xdist worker, would join this head:
    # the tests all pass one)
    os.makedirs(os.path.dirname(ray._private.utils.get_ray_address_file(None)), exist_ok=True)
    temp_dir = tempfile.mkdtemp(prefix="k3c", dir="/tmp")
    ports = {"dashboard_port": free_port()} if dashboard else {}
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=head_cpus, temp_dir=temp_dir, gcs_server_port=free_port(),
        include_dashboard=dashboard, dashboard_agent_listen_port=free_port(),
        ray_client_server_port=free_port(), **ports))  # fmt: skip
    try:
        yield cluster
    finally:
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)  # shutdown() leaves it


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_session(proc: subprocess.Popen, temp_dir: str, *, grace_s: float) -> None:
    """Stop a `ray start --block` head started in a session of its own (start_new_session):
    SIGTERM, then after grace_s SIGKILL, then SIGKILL every process left in its session or
    naming its temp dir (workers and nodes it started), then remove the temp dir. Not
    `ray stop --force`: that kills every Ray process on the host, other users' included."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for _ in range(20):
        leftovers = _pids(lambda pid, session, cmd: session == proc.pid or temp_dir in cmd)
        if not leftovers:
            break
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.25)
    shutil.rmtree(temp_dir, ignore_errors=True)


def _pids(match) -> list[int]:
    """Processes for which match(pid, session id, command line) holds."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            session = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3])
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if match(int(entry.name), session, cmd):
            out.append(int(entry.name))
    return out
