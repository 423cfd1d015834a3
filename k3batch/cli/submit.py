"""Submit k3batch jobs to a running Ray cluster through Ray Jobs, and watch or stop them.

Client side only: build the entrypoint (`python -m k3batch.cli run JOB --address auto ...`) and
the runtime_env, then talk to the cluster's dashboard (`http://HEAD:8265`), which runs the
entrypoint as the job's driver on the cluster. The cluster must be able to import k3batch and
its dependencies: install them in the image, or let the job carry the wheel
(`runtime_env={"py_modules": ["dist/k3batch-0.1.0-py3-none-any.whl"]}`).

What is uploaded (the job's working directory on the cluster) is what the job needs, not the
folder it was submitted from: the spec, and the local files it reads (`model`, `input.path`, or
the `--model` / `--input` of extra_args) when they are relative paths, so inside the working
dir. Absolute paths and URIs (s3://, gs://, ...) name storage the cluster reads itself and are
not uploaded. Dotfiles and dot-folders (.env, .git, ...) are never uploaded, and an upload over
`max_upload_bytes` (default 100 MiB) is refused with what makes it large. The files are staged
(hard links, else copies) in a temporary folder that Ray zips and uploads during the submission.

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
import glob
import logging
import os
import shlex
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

JOB_FILE_SUFFIXES = (".toml", ".yaml", ".yml")
MiB = 1 << 20
DEFAULT_MAX_UPLOAD_BYTES = 100 * MiB  # Ray's own ceiling for one package is 512 MiB (gRPC)
# The spec fields that name local paths, and the `k3batch run` flags that override them.
AGENT_WAIT_S = 60.0  # how long a just-started head may take to accept jobs
_INPUT_FIELDS = {"model": "--model", "input.path": "--input", "output.path": "--output"}
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
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
) -> str:
    """Submit `k3batch run JOB` as a Ray job and return its submission id.

    Args:
        job_path: the job spec (.toml/.yaml/.yml). It must lie inside working_dir, which
            defaults to the current directory when the file is inside it, else to the file's
            folder; the entrypoint names the file relative to working_dir. Only the spec and
            the local files it reads are uploaded (module docstring).
        address: the dashboard address, e.g. "http://HEAD:8265".
        extra_args: appended to `k3batch run JOB` (overrides such as `--model`). `--address auto`
            is added unless extra_args name `--address`.
        working_dir: the local folder that relative paths in the spec start from, and the
            job's working directory on the cluster. May also come from
            runtime_env["working_dir"]; the two must agree.
        runtime_env: merged into the job's runtime_env. env_vars get PYTHONUNBUFFERED=1 (so
            logs stream as they are written) unless they set it.
        entrypoint_num_gpus, entrypoint_num_cpus, entrypoint_resources: reserved for the
            driver process itself; the replicas ask for their own GPUs.
        submission_id: a custom id; Ray makes one when None.
        wait: block until the job ends (status via job_status); TimeoutError after timeout_s.
        token: cluster auth token (module docstring); None leaves it to Ray.
        check_spec: load the spec locally first (k3batch.driver.jobspec.load_job_spec when that
            module exists, else a TOML/YAML parse). Turn off when the spec only validates with
            overrides or names files that exist only on the cluster.
        entrypoint_override: run this shell command instead of `k3batch run` (tests, profilers).
            Then job_path must be None and nothing is uploaded unless working_dir is given
            (then all of it but its dotfiles).
        max_upload_bytes: refuse to upload more than this.

    Raises:
        ValueError: a missing, misnamed or invalid job file, conflicting arguments, a local
            file the job reads that does not exist or lies outside working_dir, or an upload
            over max_upload_bytes.
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
    uploads = None  # {path in the working dir: local file}
    if entrypoint_override is not None:
        entrypoint = entrypoint_override
        if working_dir is not None:
            root = _existing_dir(working_dir)
            uploads = _files_under(root, root, "working_dir")
    else:
        job_file = Path(job_path).resolve()
        check_job_file(job_file, load=check_spec)
        root, job_in_root = _place_job_file(job_file, working_dir)
        uploads = job_uploads(job_file, root, extra_args, must_exist=check_spec)
        entrypoint = job_entrypoint(job_in_root, extra_args)
        metadata["k3batch_job"] = job_in_root
    if uploads is not None:
        check_upload_size(uploads, max_upload_bytes)
    runtime_env["env_vars"] = {"PYTHONUNBUFFERED": "1", **runtime_env.get("env_vars", {})}

    client = _client(address, token)
    with tempfile.TemporaryDirectory(prefix="k3batch-upload-") as staging:
        if uploads is not None:
            _stage(uploads, Path(staging))
            runtime_env["working_dir"] = staging  # zipped and uploaded within submit_job
        submission_id = _submit_when_agent_up(
            client,
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


def job_uploads(
    job_file: Path, root: Path, extra_args: Sequence[str] = (), *, must_exist: bool = True
) -> dict[str, Path]:
    """What a job needs uploaded: {path relative to root: local file} for the spec and the local
    files its `model` and `input.path` name (a flag in extra_args wins over the spec). Folders
    are taken whole, globs expanded, dotfiles left out.

    Raises:
        ValueError: a relative path that leaves root, names a dotfile or (with must_exist)
            matches nothing under root.
    """
    uploads = _files_under(job_file, root, "job spec")
    named = _spec_paths(job_file) | _flag_paths(extra_args)
    output = named.pop("output.path", None)
    if output and not _is_shared(output):
        log.warning(
            "output.path = %r is relative: on the cluster it lands in the job's working dir, a "
            "temporary folder; give an absolute path or a URI to keep the results",
            output,
        )
    for field, value in sorted(named.items()):
        if _is_shared(value):
            continue
        if not Path(os.path.normpath(root / value)).is_relative_to(root):
            raise ValueError(
                f"{field} = {value!r} is outside the working dir {str(root)!r}, so it would not "
                "reach the cluster"
            )
        if glob.has_magic(value):  # pathlib's glob matches dotfiles too; a shell's does not
            matches = [m for m in sorted(root.glob(value)) if not _is_dotted(m.name)]
        else:
            matches = [root / value]
        matches = [m for m in matches if m.exists()]
        if not matches:
            if must_exist:
                raise ValueError(
                    f"{field} = {value!r}: nothing there under {root}; a relative path is "
                    "uploaded from there, so it must exist (an absolute path or a URI names "
                    "storage the cluster reads itself)"
                )
            log.warning("%s = %r does not exist here; not uploaded", field, value)
        for path in matches:
            uploads |= _files_under(path, root, f"{field} = {value!r}")
    return uploads


def check_upload_size(uploads: dict[str, Path], max_upload_bytes: int) -> None:
    """ValueError when the files add up to more than max_upload_bytes, naming the largest
    top-level entries (folders summed)."""
    sizes: dict[str, int] = {}
    for rel, path in uploads.items():
        top = rel.split("/")[0] + ("/" if "/" in rel else "")
        sizes[top] = sizes.get(top, 0) + path.stat().st_size
    total = sum(sizes.values())
    log.info("uploading %d files, %.1f MiB", len(uploads), total / MiB)
    if total <= max_upload_bytes:
        return
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
    what = ", ".join(f"{name} {size / MiB:.1f} MiB" for name, size in largest)
    raise ValueError(
        f"refusing to upload {total / MiB:.1f} MiB to the cluster (limit "
        f"{max_upload_bytes / MiB:.1f} MiB): {what}. Every upload goes through the cluster's "
        "head with each job; put large checkpoints and data on storage the cluster reads (an "
        "absolute path or a URI such as s3://...) or raise the limit (--max-upload-mib)"
    )


def check_job_file(path: str | Path, *, load: bool = True) -> None:
    """Raise ValueError unless `path` is a .toml/.yaml/.yml file that loads.

    Uses k3batch.driver.jobspec.load_job_spec when that module exists; otherwise only parses the
    file.
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
        from k3batch.driver.jobspec import load_job_spec
    except ModuleNotFoundError as e:
        if e.name not in ("k3batch.driver", "k3batch.driver.jobspec"):
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


def _submit_when_agent_up(client, *, wait_s: float = AGENT_WAIT_S, **kwargs) -> str:
    """client.submit_job, retried while the head answers that no agent is up yet (a head that
    has just started; Ray asks to try again later). Any other error is raised at once."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return client.submit_job(**kwargs)
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
            log.info("no job agent on the head yet; retrying")
            time.sleep(1.0)


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


def _parse_job_file(path: Path) -> dict:
    text = path.read_text()
    try:
        if path.suffix.lower() == ".toml":
            import tomllib

            return tomllib.loads(text)
        import yaml

        raw = yaml.safe_load(text)
    except Exception as e:  # tomllib.TOMLDecodeError, yaml.YAMLError
        raise ValueError(f"job file {str(path)!r} does not parse: {e}") from e
    return raw if isinstance(raw, dict) else {}


def _spec_paths(job_file: Path) -> dict[str, str]:
    """The spec's `model`, `input.path` and `output.path`, when they are strings."""
    raw = _parse_job_file(job_file)
    values = {"model": raw.get("model")}
    for name in ("input", "output"):
        section = raw.get(name)
        values[f"{name}.path"] = section.get("path") if isinstance(section, dict) else None
    return {k: v for k, v in values.items() if isinstance(v, str) and v}


def _flag_paths(args: Sequence[str]) -> dict[str, str]:
    """`--model X`, `--input=X` and the like among `k3batch run` arguments."""
    out = {}
    for field, flag in _INPUT_FIELDS.items():
        for i, arg in enumerate(args):
            if arg == flag and i + 1 < len(args):
                out[field] = args[i + 1]
            elif arg.startswith(flag + "="):
                out[field] = arg[len(flag) + 1 :]
    return out


def _is_shared(path: str) -> bool:
    """An absolute path or a URI: storage the cluster reads itself, never uploaded."""
    return "://" in path or Path(path).is_absolute()


def _files_under(path: Path, root: Path, what: str) -> dict[str, Path]:
    """{path relative to root: file} for a file, or every file below a folder, without
    dotfiles and dot-folders; ValueError if `path` leaves root or is itself a dotfile."""
    try:  # lexically: a symbolic link inside root may point elsewhere (its files are uploaded)
        rel = Path(os.path.normpath(path.absolute())).relative_to(root)
    except ValueError:
        raise ValueError(
            f"{what}: {str(path)!r} is outside the working dir {str(root)!r}, so it would not "
            "reach the cluster"
        ) from None
    if _is_dotted(rel.parts):
        raise ValueError(f"{what}: {rel.as_posix()!r} is a dotfile; dotfiles are never uploaded")
    if path.is_file():
        return {rel.as_posix(): path}
    out = {}
    for folder, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith("."):
                file = Path(folder) / name
                out[(rel / file.relative_to(path)).as_posix()] = file
    return out


def _is_dotted(parts: Sequence[str] | str) -> bool:
    return any(p.startswith(".") for p in ([parts] if isinstance(parts, str) else parts))


def _stage(uploads: dict[str, Path], dest: Path) -> None:
    """Lay the files out under dest: hard links where possible, else copies."""
    for rel, src in uploads.items():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, target)
        except OSError:
            shutil.copy2(src, target)


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
