"""Submit k3batch jobs to a running Ray cluster through Ray Jobs, and watch or stop them.

Client side only: build the entrypoint (`python -m k3batch.cli run JOB --address auto ...`) and
the runtime_env, then talk to the cluster's dashboard (`http://HEAD:8265`), which runs the
entrypoint as the job's driver on the cluster. The cluster must be able to import k3batch and
its dependencies: install them in the image, or let the job carry them (a working_dir at the
repo root puts `k3batch/` on the driver's path; add `pip` or `py_modules` to runtime_env for the
rest). Only local working_dir folders are supported here; Ray uploads them, minus .gitignored
files.

Token authentication, as found in the installed ray 2.60.0 (paths under ray/):
- The dashboard, and with it the Jobs API, checks tokens only when its RAY_AUTH_MODE is
  "token". It reads `Authorization: Bearer <token>`, else `X-Ray-Authorization`, else the cookie
  `ray-authentication-token`; missing gives 401, wrong gives 403
  (_private/authentication/http_token_authentication.py:118-150).
- `ray.init()` starting a new local cluster turns token mode on unless RAY_AUTH_MODE is set, and
  writes a new token to ~/.ray/auth_token if none is found (_private/worker.py:1873-1876;
  _private/authentication/authentication_token_setup.py:55-61, 109-118, 152-160).
  `ray start --head` turns it on when RAY_AUTH_MODE=token, or when RAY_AUTH_MODE is unset and a
  token already exists (scripts/scripts.py:1069; authentication_token_setup.py:92-106). So once
  a local `ray.init()` has run on a machine, later `ray start --head` clusters there need tokens.
- JobSubmissionClient sends a token only when the client process itself runs with
  RAY_AUTH_MODE=token; it then takes RAY_AUTH_TOKEN, else the file named by
  RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token. An Authorization header passed by the caller is
  kept as is (dashboard/modules/dashboard_sdk.py:242-243;
  _private/authentication/http_token_authentication.py:157-183). Without RAY_AUTH_MODE=token on
  the client, no token is sent and calls fail with ray.exceptions.AuthenticationError.
- The job's driver inherits RAY_AUTH_MODE and the token from the cluster's processes, so the
  `ray.init()` inside `k3batch run` needs nothing extra.
Every function here takes `token=`: when given, it is sent as `Authorization: Bearer <token>`
whatever RAY_AUTH_MODE says; when None, Ray's own rules above apply.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

JOB_FILE_SUFFIXES = (".toml", ".yaml", ".yml")
TERMINAL_STATUSES = ("SUCCEEDED", "FAILED", "STOPPED")
# The driver joins the cluster it runs on: "auto" resolves to RAY_ADDRESS, which Ray Jobs sets.
_RUN_COMMAND = ("python", "-m", "k3batch.cli", "run")


def submit_job(
    job_path: str | None,
    *,
    address: str,
    extra_args: Sequence[str] = (),
    working_dir: str | None = None,
    runtime_env: dict | None = None,
    entrypoint_num_gpus: float | None = None,
    entrypoint_num_cpus: float | None = None,
    entrypoint_resources: dict | None = None,
    submission_id: str | None = None,
    wait: bool = False,
    timeout_s: float | None = None,
    token: str | None = None,
    check_spec: bool = True,
    entrypoint_override: str | None = None,
) -> str:
    """Submit `k3batch run JOB` as a Ray job and return its submission id.

    Args:
        job_path: the job spec (.toml/.yaml/.yml). It must lie inside working_dir, which
            defaults to the current directory when the file is inside it, else to the file's
            folder; the entrypoint names the file relative to working_dir.
        address: the dashboard address, e.g. "http://HEAD:8265".
        extra_args: appended to `k3batch run JOB` (overrides such as `--model`). `--address auto`
            is added unless extra_args name `--address`.
        working_dir: local folder uploaded as the job's working directory. May also come from
            runtime_env["working_dir"]; the two must agree.
        runtime_env: merged into the job's runtime_env. env_vars get PYTHONUNBUFFERED=1 (so
            logs stream as they are written) unless they set it.
        entrypoint_num_gpus, entrypoint_num_cpus, entrypoint_resources: reserved for the
            driver process itself; the replicas ask for their own GPUs.
        submission_id: a custom id; Ray makes one when None.
        wait: block until the job ends (status via job_status); TimeoutError after timeout_s.
        token: cluster auth token (module docstring); None leaves it to Ray.
        check_spec: load the spec locally first (k3batch.jobspec.load_job_spec when that module
            exists, else a TOML/YAML parse). Turn off when the spec only validates with
            overrides or names files that exist only on the cluster.
        entrypoint_override: run this shell command instead of `k3batch run` (tests, profilers).
            Then job_path must be None and nothing is uploaded unless working_dir is given.

    Raises:
        ValueError: a missing, misnamed or invalid job file, or conflicting arguments.
    """
    if (job_path is None) == (entrypoint_override is None):
        raise ValueError("pass exactly one of job_path and entrypoint_override")
    runtime_env = dict(runtime_env or {})
    env_working_dir = runtime_env.pop("working_dir", None)
    if (
        working_dir is not None
        and env_working_dir is not None
        and Path(working_dir).resolve() != Path(env_working_dir).resolve()
    ):
        raise ValueError(
            f"working_dir {working_dir!r} != runtime_env working_dir {env_working_dir!r}"
        )
    working_dir = working_dir if working_dir is not None else env_working_dir

    metadata = {}
    if entrypoint_override is not None:
        entrypoint = entrypoint_override
        if working_dir is not None:
            working_dir = str(_existing_dir(working_dir))
    else:
        job_file = Path(job_path).resolve()
        check_job_file(job_file, load=check_spec)
        root, job_in_root = _place_job_file(job_file, working_dir)
        working_dir = str(root)
        entrypoint = job_entrypoint(job_in_root, extra_args)
        metadata["k3batch_job"] = job_in_root

    if working_dir is not None:
        runtime_env["working_dir"] = working_dir
    runtime_env["env_vars"] = {"PYTHONUNBUFFERED": "1", **runtime_env.get("env_vars", {})}

    client = _client(address, token)
    submission_id = client.submit_job(
        entrypoint=entrypoint,
        submission_id=submission_id,
        runtime_env=runtime_env,
        metadata=metadata,
        entrypoint_num_cpus=entrypoint_num_cpus,
        entrypoint_num_gpus=entrypoint_num_gpus,
        entrypoint_resources=entrypoint_resources,
    )
    if wait:
        wait_for_job(submission_id, address=address, timeout_s=timeout_s, token=token)
    return submission_id


def job_entrypoint(job_in_working_dir: str, extra_args: Sequence[str] = ()) -> str:
    """The shell command Ray runs as the driver: `python -m k3batch.cli run JOB ...`."""
    args = [*_RUN_COMMAND, job_in_working_dir]
    if not any(a == "--address" or a.startswith("--address=") for a in extra_args):
        args += ["--address", "auto"]
    return shlex.join([*args, *extra_args])


def check_job_file(path: str | Path, *, load: bool = True) -> None:
    """Raise ValueError unless `path` is a .toml/.yaml/.yml file that loads.

    Uses k3batch.jobspec.load_job_spec when that module exists; otherwise only parses the file.
    With load=False only the name and existence are checked.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"job file {str(path)!r} does not exist")
    if path.suffix.lower() not in JOB_FILE_SUFFIXES:
        raise ValueError(f"job file {str(path)!r} must end in one of {JOB_FILE_SUFFIXES}")
    if not load:
        return
    try:
        from k3batch.jobspec import load_job_spec
    except ModuleNotFoundError as e:
        if e.name != "k3batch.jobspec":
            raise
        _parse_job_file(path)
    else:
        load_job_spec(str(path))


def job_status(submission_id: str, *, address: str, token: str | None = None) -> str:
    """The job's status: PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED."""
    return str(_client(address, token).get_job_status(submission_id).value)


def job_logs(
    submission_id: str, *, address: str, follow: bool = False, token: str | None = None
) -> Iterator[str]:
    """Yield the job's driver output in chunks.

    follow=False yields what exists now. follow=True streams new output until the job ends or
    the connection drops (a dropped stream raises RuntimeError; the job itself keeps running).
    """
    client = _client(address, token)
    if not follow:
        yield client.get_job_logs(submission_id)
        return
    yield from _iterate_async(client.tail_job_logs(submission_id))


def stop_job(submission_id: str, *, address: str, token: str | None = None) -> bool:
    """Ask Ray to stop the job; False if it had already ended. Stopping is asynchronous: the
    status turns STOPPED a moment later (wait_for_job)."""
    return bool(_client(address, token).stop_job(submission_id))


def wait_for_job(
    submission_id: str,
    *,
    address: str,
    timeout_s: float | None = None,
    poll_s: float = 1.0,
    token: str | None = None,
) -> str:
    """Poll until the job is SUCCEEDED, FAILED or STOPPED and return that status.

    Raises:
        TimeoutError: still running after timeout_s (None waits forever).
    """
    client = _client(address, token)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        status = str(client.get_job_status(submission_id).value)
        if status in TERMINAL_STATUSES:
            return status
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"job {submission_id} still {status} after {timeout_s} s")
        time.sleep(poll_s)


def _client(address: str, token: str | None):
    from ray.job_submission import JobSubmissionClient  # heavy import, only when used

    headers = {"Authorization": f"Bearer {token}"} if token else None
    return JobSubmissionClient(address, headers=headers)


def _existing_dir(path: str) -> Path:
    resolved = Path(path).resolve()
    if not resolved.is_dir():
        raise ValueError(f"working_dir {path!r} is not a folder")
    return resolved


def _place_job_file(job_file: Path, working_dir: str | None) -> tuple[Path, str]:
    """Pick the folder to upload and the job file's POSIX path inside it."""
    if working_dir is None:
        cwd = Path.cwd().resolve()
        root = cwd if job_file.is_relative_to(cwd) else job_file.parent
    else:
        root = _existing_dir(working_dir)
        if not job_file.is_relative_to(root):
            raise ValueError(
                f"job file {str(job_file)!r} is not inside working_dir {str(root)!r}, "
                "so it would not reach the cluster"
            )
    return root, job_file.relative_to(root).as_posix()


def _parse_job_file(path: Path) -> None:
    text = path.read_text()
    try:
        if path.suffix.lower() == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10: no TOML parser in the stdlib
                return
            tomllib.loads(text)
        else:
            import yaml

            yaml.safe_load(text)
    except Exception as e:  # tomllib.TOMLDecodeError, yaml.YAMLError
        raise ValueError(f"job file {str(path)!r} does not parse: {e}") from e


def _iterate_async(agen) -> Iterator:
    """Drive an async generator from synchronous code on a private event loop."""
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                yield loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                return
    finally:
        loop.run_until_complete(agen.aclose())
        loop.close()
