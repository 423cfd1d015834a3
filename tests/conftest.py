import dataclasses
import os
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Every Ray process of the test session (the shared head, its drivers and jobs) uses token
# authentication with one session token. Set before Ray is imported: Ray caches both.
os.environ["RAY_AUTH_MODE"] = "token"
os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(16)

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU, Triton kernels run through Triton's interpreter (tiny shapes), so CI checks every
# kernel against its reference. Read when a kernel is decorated and by `k3kernels.INTERPRETED`
# (the bf16 upcasts the interpreter needs): set before k3batch, which imports the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from k3batch.model import K3Model, get_flavor  # noqa: E402
from k3batch.model.init import init_random_  # noqa: E402
from k3batch.model.weights import write_checkpoint  # noqa: E402
from k3batch.testing.simcluster import free_port, stop_session  # noqa: E402
from k3batch.cli.submit import _client  # noqa: E402
from k3batch.testing import K3_MINI  # noqa: E402


# The tiny CPU models are bound by per-op overhead; one intra-op thread avoids spin contention
# on small CI machines.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_factory():
    """Cached fp32 random-weight models (seed 0), in eval mode, by flavor name or "k3-mini"
    (k3batch.testing.K3_MINI)."""
    cache = {}

    def get(flavor: str) -> K3Model:
        if flavor not in cache:
            config = K3_MINI if flavor == "k3-mini" else get_flavor(flavor)
            model = K3Model(config, dtype=torch.float32)
            cache[flavor] = init_random_(model, seed=0).eval()
        return cache[flavor]

    return get


@pytest.fixture(scope="session")
def mini_model_dir(tmp_path_factory) -> str:
    """A checkpoint of k3batch.testing.K3_MINI (seed 0; MXFP4 experts, as init-checkpoint
    writes k3-debug), written once per session."""
    path = tmp_path_factory.mktemp("ckpt") / "k3-mini"
    write_checkpoint(dataclasses.replace(K3_MINI, experts_mxfp4=True), path, seed=0)
    return str(path)


# ---- pytest-xdist (`make test`: two workers, --dist loadfile) ---------------------------------
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile (each test file whole on one worker: its module fixtures, models,
    reference runs and Ray clusters, built once), with tests/kernels all on one worker: the
    sm_90 compile check (`kernels/test_sm90_compile.py`, last) compiles every kernel launch
    made in its process. (--dist loadgroup would say it with marks, but xdist 3.8 cannot set a
    group on pytest 9's node ids.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class KernelsTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith("tests/kernels/"):
                return "tests/kernels"
            return super()._split_scope(nodeid)

    return KernelsTogether(config, log)


# ---- a local Ray head for the Ray tests: token auth on, its own session, stopped afterwards ----
RAY = str(Path(sys.executable).with_name("ray"))
STARTUP_TIMEOUT_S = 60


@dataclass(frozen=True)
class Head:
    address: str  # dashboard, http://127.0.0.1:PORT (Ray Jobs)
    gcs_address: str  # 127.0.0.1:PORT (ray.init)
    token: str


@pytest.fixture(scope="session")
def ray_head():
    """One head per test session; under pytest-xdist (`make test`) one per worker, which share
    nothing: each has its own temp dir, free ports and token."""
    token = os.environ["RAY_AUTH_TOKEN"]
    # Short path: Ray's unix socket paths live under it (108-byte limit).
    temp_dir = tempfile.mkdtemp(prefix="k3r", dir="/tmp")
    dashboard_port, gcs_port = free_port(), free_port()
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
        # The job driver runs `python`: make it this venv's, as an activated venv would.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("RAY_ADDRESS", None)
    cmd = [
        RAY,
        "start",
        "--head",
        "--block",
        "--num-cpus=12",
        "--include-dashboard=true",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
        "--dashboard-host=127.0.0.1",
        f"--port={gcs_port}",
        f"--dashboard-port={dashboard_port}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--ray-client-server-port={free_port()}",
    ]
    log_path = Path(temp_dir) / "ray_start.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        head = Head(f"http://127.0.0.1:{dashboard_port}", f"127.0.0.1:{gcs_port}", token)
        _wait_for_dashboard(head, proc, log_path)
        yield head
    finally:
        # The graceful stop took the whole 20 s it was given at the suite's last teardown;
        # nothing of the head has to outlive the suite.
        stop_session(proc, temp_dir, grace_s=3)


def _wait_for_dashboard(head: Head, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"ray start exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            _client(head.address, head.token).list_jobs()
            return
        except ConnectionError:
            if time.monotonic() > deadline:
                pytest.fail(
                    f"dashboard not up after {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}"
                )
            time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster(ray_head):
    """This process joins the shared head as a driver (the token is in the environment)."""
    import ray

    ray.init(address=ray_head.gcs_address)
    yield ray_head
    ray.shutdown()


@pytest.fixture(scope="module")
def local_ray():
    """A Ray of this process alone, without the dashboard, for tests that need only actors: the
    GPU hosts lack the dashboard's packages, which the shared head (`cluster`) starts."""
    import ray

    ray.init(include_dashboard=False, num_cpus=8)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def numbers(request):
    """A MetricsTable named by the module's NUMBERS_TABLE, printed (past output capture) after
    the module and saved to $K3_NUMCHECK_OUT when set: the GPU tests' numerical report."""
    from k3batch.testing import MetricsTable

    table = MetricsTable(request.module.NUMBERS_TABLE, os.environ.get("K3_NUMCHECK_OUT"))
    yield table
    capman = request.config.pluginmanager.getplugin("capturemanager")
    if capman is None:
        print("\n" + table.format())
    else:
        with capman.global_and_fixture_disabled():
            print("\n" + table.format())
