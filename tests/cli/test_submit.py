"""Ray Jobs submission (k3batch.cli.submit, k3batch.cli.jobs) against a real local Ray head.

The head runs with token authentication on (RAY_AUTH_MODE=token), as any `ray start --head` does
on a machine that already holds ~/.ray/auth_token, so every call here must carry the token.
Jobs use entrypoint_override: `k3batch run` is tested end to end elsewhere.

What is uploaded: only the spec and the local files it reads, never dotfiles, at most
max_upload_bytes. These tests fail on the old submit_job, which uploaded the whole current
folder (`runtime_env["working_dir"] = str(root)`).
"""

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from k3batch.cli import submit as submit_mod
from k3batch.cli.jobs import register
from k3batch.cli.submit import (
    check_job_file,
    job_entrypoint,
    job_logs,
    job_status,
    stop_job,
    submit_job,
    wait_for_job,
)

JOB_TIMEOUT_S = 45


def _python_c(code: str) -> str:
    return shlex.join(["python", "-c", code])


def _cli() -> click.Group:
    group = click.Group("k3batch")
    register(group)
    return group


# --- against the running head ---


def test_submit_job_runs_in_uploaded_working_dir(ray_head, tmp_path):
    (tmp_path / "marker.txt").write_text("uploaded")
    submission_id = submit_job(
        None,
        address=ray_head.address,
        token=ray_head.token,
        working_dir=str(tmp_path),
        entrypoint_override=_python_c("print('ok', open('marker.txt').read())"),
    )
    status = wait_for_job(
        submission_id, address=ray_head.address, timeout_s=JOB_TIMEOUT_S, token=ray_head.token
    )
    logs = "".join(job_logs(submission_id, address=ray_head.address, token=ray_head.token))
    assert status == "SUCCEEDED", logs
    assert "ok uploaded" in logs


def test_submit_job_file_runs_k3batch_run_in_working_dir(ray_head, tmp_path):
    # A stand-in k3batch package (carried as a py_module) records the command line it gets and
    # what the working dir holds: the spec and the model folder it names, nothing else.
    stub = tmp_path / "stub" / "k3batch"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    (stub / "cli.py").write_text(
        "import os, sys\nprint('argv', sys.argv[1:])\n"
        "print('files', sorted(os.path.join(d, f)[2:] for d, _, fs in os.walk('.') for f in fs))\n"
    )
    wd = tmp_path / "wd"
    (wd / "jobs").mkdir(parents=True)
    (wd / "jobs" / "tiny.toml").write_text('model = "m"\n')
    (wd / "m").mkdir()
    (wd / "m" / "config.json").write_text("{}")
    (wd / ".env").write_text("SECRET=1")
    (wd / "data.bin").write_bytes(b"x" * 1000)
    kw = {"address": ray_head.address, "token": ray_head.token}
    submission_id = submit_job(
        str(wd / "jobs" / "tiny.toml"),
        working_dir=str(wd),
        extra_args=["--output", "/tmp/out dir"],
        runtime_env={"py_modules": [str(stub)]},
        wait=True,
        timeout_s=JOB_TIMEOUT_S,
        check_spec=False,
        **kw,
    )
    logs = "".join(job_logs(submission_id, **kw))
    assert job_status(submission_id, **kw) == "SUCCEEDED", logs
    expected = ["run", "jobs/tiny.toml", "--address", "auto", "--output", "/tmp/out dir"]
    assert f"argv {expected}" in logs
    assert f"files {['jobs/tiny.toml', 'm/config.json']}" in logs


def test_stop_job_stops_running_job(ray_head):
    kw = {"address": ray_head.address, "token": ray_head.token}
    sleeper = _python_c("import time; time.sleep(60)")
    submission_id = submit_job(None, entrypoint_override=sleeper, **kw)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while job_status(submission_id, **kw) == "PENDING" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert job_status(submission_id, **kw) == "RUNNING"
    assert stop_job(submission_id, **kw)
    assert wait_for_job(submission_id, timeout_s=JOB_TIMEOUT_S, **kw) == "STOPPED"
    assert not stop_job(submission_id, **kw)  # already ended


def test_cli_submit_wait_streams_logs_and_status(ray_head):
    args = ["submit", "--address", ray_head.address, "--wait", "--entrypoint"]
    ok = CliRunner().invoke(
        _cli(), [*args, _python_c("print('ok')")], env={"RAY_AUTH_TOKEN": ray_head.token}
    )
    assert ok.exit_code == 0, ok.output
    submission_id = ok.output.splitlines()[0]
    assert "ok\n" in ok.output
    assert ok.output.rstrip().endswith(f"{submission_id} SUCCEEDED")

    failed = CliRunner().invoke(
        _cli(), [*args, _python_c("import sys; sys.exit(3)"), "--token", ray_head.token]
    )
    assert failed.exit_code == 1, failed.output
    assert failed.output.rstrip().endswith("FAILED")


def test_cli_without_token_reports_authentication(ray_head, tmp_path):
    # A fresh process: Ray caches the auth mode and token per process. HOME is empty, so no
    # ~/.ray/auth_token is found either.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | {
        "HOME": str(tmp_path)
    }
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "k3batch.cli",
            "status",
            "raysubmit_none",
            "--address",
            ray_head.address,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "Authentication required" in result.stdout + result.stderr


def test_cli_status_of_unknown_job_fails(ray_head):
    result = CliRunner().invoke(
        _cli(),
        ["status", "raysubmit_none", "--address", ray_head.address, "--token", ray_head.token],
    )
    assert result.exit_code == 1
    assert "raysubmit_none" in result.output


# --- no cluster needed ---


def test_cli_submit_missing_job_file_names_it(tmp_path):
    missing = tmp_path / "missing_job.toml"
    result = CliRunner().invoke(_cli(), ["submit", str(missing), "--address", "http://x:8265"])
    assert result.exit_code != 0
    assert "missing_job.toml" in result.output


def test_check_job_file_rejects_bad_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        check_job_file(tmp_path / "none.toml")
    (tmp_path / "job.json").write_text("{}")
    with pytest.raises(ValueError, match="must end in"):
        check_job_file(tmp_path / "job.json")
    (tmp_path / "broken.toml").write_text("model = [unclosed\n")
    with pytest.raises(ValueError):
        check_job_file(tmp_path / "broken.toml")


def test_job_entrypoint_quotes_args_and_joins_cluster():
    assert job_entrypoint("jobs/a b.toml", ["--model", "/ckpt"]) == (
        "python -m k3batch.cli run 'jobs/a b.toml' --address auto --model /ckpt"
    )
    assert job_entrypoint("j.toml", ["--address=ray://h:10001"]) == (
        "python -m k3batch.cli run j.toml --address=ray://h:10001"
    )


class _FakeClient:
    """Records what submit_job sends, and the files staged for upload at that moment."""

    def __init__(self):
        self.kwargs = None
        self.uploaded = None

    def submit_job(self, **kwargs):
        self.kwargs = kwargs
        wd = kwargs["runtime_env"].get("working_dir")
        if wd is not None:
            files = [p for p in Path(wd).rglob("*") if p.is_file()]
            self.uploaded = {p.relative_to(wd).as_posix(): p.read_bytes() for p in files}
        return "raysubmit_fake"


@pytest.fixture
def fake_client(monkeypatch):
    client = _FakeClient()
    monkeypatch.setattr(submit_mod, "_client", lambda address, token: client)
    return client


def test_submit_job_uploads_the_spec_and_names_it_relative(tmp_path, monkeypatch, fake_client):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "big.toml").write_text("")
    (tmp_path / "other.txt").write_text("not needed")
    monkeypatch.chdir(tmp_path)
    submission_id = submit_job(
        "jobs/big.toml",
        address="http://h:8265",
        extra_args=["--output", "/out"],
        runtime_env={"env_vars": {"HF_HOME": "/cache"}},
        entrypoint_num_cpus=1,
        check_spec=False,
    )
    assert submission_id == "raysubmit_fake"
    kw = fake_client.kwargs
    assert kw["entrypoint"] == (
        "python -m k3batch.cli run jobs/big.toml --address auto --output /out"
    )
    assert kw["runtime_env"]["env_vars"] == {"PYTHONUNBUFFERED": "1", "HF_HOME": "/cache"}
    assert set(kw["runtime_env"]) == {"working_dir", "env_vars"}
    assert not Path(kw["runtime_env"]["working_dir"]).exists()  # staging removed afterwards
    assert fake_client.uploaded == {"jobs/big.toml": b""}
    assert kw["metadata"] == {"k3batch_job": "jobs/big.toml"}
    assert kw["entrypoint_num_cpus"] == 1


def test_submit_job_outside_cwd_uploads_from_its_folder(tmp_path, monkeypatch, fake_client):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "j.yaml").write_text("model: ckpt\n")
    (tmp_path / "elsewhere" / "ckpt").mkdir()
    (tmp_path / "elsewhere" / "ckpt" / "config.json").write_text("{}")
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    submit_job(str(tmp_path / "elsewhere" / "j.yaml"), address="http://h:8265", check_spec=False)
    assert sorted(fake_client.uploaded) == ["ckpt/config.json", "j.yaml"]
    assert " run j.yaml " in fake_client.kwargs["entrypoint"]


def test_submit_job_rejects_job_outside_working_dir(tmp_path, fake_client):
    (tmp_path / "wd").mkdir()
    (tmp_path / "j.toml").write_text("")
    with pytest.raises(ValueError, match="not inside working_dir"):
        submit_job(
            str(tmp_path / "j.toml"), address="http://h:8265", working_dir=str(tmp_path / "wd")
        )
    with pytest.raises(ValueError, match="exactly one"):
        submit_job(str(tmp_path / "j.toml"), address="http://h:8265", entrypoint_override="true")


def _project(root: Path) -> None:
    """A folder as users have them: the job, its checkpoint and data, and much it does not need."""
    files = {
        "jobs/job.toml": 'model = "ckpt"\n[input]\npath = "data/*.parquet"\n'
        '[output]\npath = "out"\n',
        "ckpt/config.json": "{}",
        "ckpt/model.safetensors": "w" * 100,
        "ckpt/.cache/tmp": "x",
        "data/a.parquet": "a",
        "data/b.parquet": "b",
        "data/.c.parquet": "hidden",
        "data/notes.txt": "not matched by the glob",
        "old_ckpt/model.safetensors": "w" * 10_000,
        "other.parquet": "o",
        "out/shard.parquet": "earlier output",
        ".env": "SECRET=1",
        ".git/config": "x",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_submit_uploads_only_what_the_job_reads(tmp_path, monkeypatch, fake_client, caplog):
    _project(tmp_path)
    monkeypatch.chdir(tmp_path)
    submit_job("jobs/job.toml", address="http://h:8265", check_spec=False)
    assert "output.path = 'out' is relative" in caplog.text  # out/ is not uploaded either
    assert sorted(fake_client.uploaded) == [
        "ckpt/config.json",
        "ckpt/model.safetensors",
        "data/a.parquet",
        "data/b.parquet",
        "jobs/job.toml",
    ]
    # Flags after `--` win over the spec; absolute paths and URIs are not uploaded.
    submit_job(
        "jobs/job.toml",
        address="http://h:8265",
        extra_args=["--input=other.parquet", "--model", str(tmp_path / "old_ckpt")],
        check_spec=False,
    )
    assert sorted(fake_client.uploaded) == ["jobs/job.toml", "other.parquet"]
    submit_job("jobs/job.toml", address="http://h:8265", extra_args=["--model", "s3://b/ckpt",
               "--input", "gs://b/data/*.parquet"], check_spec=False)  # fmt: skip
    assert sorted(fake_client.uploaded) == ["jobs/job.toml"]


def test_submit_refuses_dotfiles_missing_and_outside_paths(tmp_path, monkeypatch, fake_client):
    _project(tmp_path)
    monkeypatch.chdir(tmp_path)
    for args, words in [
        (["--model", ".env"], "dotfiles are never uploaded"),
        (["--input", "data/.c.parquet"], "dotfiles are never uploaded"),
        (["--model", "../x"], "outside the working dir"),
        (["--input", "nothing/*.parquet"], "nothing there"),
    ]:
        with pytest.raises(ValueError, match=words):
            submit_job("jobs/job.toml", address="http://h:8265", extra_args=args)
    assert fake_client.kwargs is None  # nothing was submitted


def test_submit_refuses_large_uploads_saying_why(tmp_path, monkeypatch, fake_client):
    _project(tmp_path)
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"w" * (3 << 20))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as err:
        submit_job("jobs/job.toml", address="http://h:8265", max_upload_bytes=2 << 20,
                   check_spec=False)  # fmt: skip
    msg = str(err.value)
    assert "refusing to upload 3.0 MiB" in msg and "limit 2.0 MiB" in msg
    assert "ckpt/ 3.0 MiB" in msg and "storage the cluster reads" in msg
    assert fake_client.kwargs is None
    result = CliRunner().invoke(
        _cli(), ["submit", "jobs/job.toml", "--address", "http://h:8265", "--no-check",
                 "--max-upload-mib", "2"],
    )  # fmt: skip
    assert result.exit_code == 1 and "refusing to upload 3.0 MiB" in result.output


def test_submit_entrypoint_with_working_dir_leaves_dotfiles(tmp_path, fake_client):
    _project(tmp_path)
    submit_job(None, address="http://h:8265", working_dir=str(tmp_path), entrypoint_override="ls")
    assert not [f for f in fake_client.uploaded if f.startswith(".") or "/." in f]
    assert "old_ckpt/model.safetensors" in fake_client.uploaded


def test_submit_retries_while_the_head_has_no_agent(monkeypatch):
    """A just-started head answers 500 'No available agent ... try again later' for a while."""
    calls = []

    class Client:
        def submit_job(self, **kwargs):
            calls.append(kwargs)
            if len(calls) < 3:
                raise RuntimeError("Request failed with status code 500: No available agent")
            return "raysubmit_late"

    monkeypatch.setattr(submit_mod.time, "sleep", lambda s: None)
    assert submit_mod._submit_when_agent_up(Client(), entrypoint="true") == "raysubmit_late"
    assert len(calls) == 3

    class Broken:
        def submit_job(self, **kwargs):
            raise RuntimeError("Request failed with status code 400: bad runtime_env")

    with pytest.raises(RuntimeError, match="bad runtime_env"):
        submit_mod._submit_when_agent_up(Broken(), entrypoint="true")
