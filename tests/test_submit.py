"""Ray Jobs submission (k3batch.submit, k3batch.cli_jobs) against a real local Ray head.

The head runs with token authentication on (RAY_AUTH_MODE=token), as any `ray start --head` does
on a machine that already holds ~/.ray/auth_token, so every call here must carry the token.
Jobs use entrypoint_override: `k3batch run` is tested end to end elsewhere.
"""

import os
import shlex
import subprocess
import sys
import time

import click
import pytest
from click.testing import CliRunner

from k3batch import submit as submit_mod
from k3batch.cli_jobs import register
from k3batch.submit import (
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
    # A stand-in k3batch package in the uploaded folder records the command line it gets;
    # `python -m` puts the working dir first on sys.path.
    (tmp_path / "k3batch").mkdir()
    (tmp_path / "k3batch" / "__init__.py").write_text("")
    (tmp_path / "k3batch" / "cli.py").write_text("import sys\nprint('argv', sys.argv[1:])\n")
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "tiny.toml").write_text('model = "m"\n')
    kw = {"address": ray_head.address, "token": ray_head.token}
    submission_id = submit_job(
        str(tmp_path / "jobs" / "tiny.toml"),
        working_dir=str(tmp_path),
        extra_args=["--output", "/tmp/out dir"],
        wait=True,
        timeout_s=JOB_TIMEOUT_S,
        **kw,
    )
    logs = "".join(job_logs(submission_id, **kw))
    assert job_status(submission_id, **kw) == "SUCCEEDED", logs
    expected = ["run", "jobs/tiny.toml", "--address", "auto", "--output", "/tmp/out dir"]
    assert f"argv {expected}" in logs


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
    def __init__(self):
        self.kwargs = None

    def submit_job(self, **kwargs):
        self.kwargs = kwargs
        return "raysubmit_fake"


@pytest.fixture
def fake_client(monkeypatch):
    client = _FakeClient()
    monkeypatch.setattr(submit_mod, "_client", lambda address, token: client)
    monkeypatch.setattr(submit_mod, "check_job_file", lambda path, load=True: None)
    return client


def test_submit_job_uploads_cwd_and_names_job_relative(tmp_path, monkeypatch, fake_client):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "big.toml").write_text("")
    monkeypatch.chdir(tmp_path)
    submission_id = submit_job(
        "jobs/big.toml",
        address="http://h:8265",
        extra_args=["--output", "/out"],
        runtime_env={"env_vars": {"HF_HOME": "/cache"}},
        entrypoint_num_cpus=1,
    )
    assert submission_id == "raysubmit_fake"
    kw = fake_client.kwargs
    assert kw["entrypoint"] == (
        "python -m k3batch.cli run jobs/big.toml --address auto --output /out"
    )
    assert kw["runtime_env"] == {
        "working_dir": str(tmp_path.resolve()),
        "env_vars": {"PYTHONUNBUFFERED": "1", "HF_HOME": "/cache"},
    }
    assert kw["metadata"] == {"k3batch_job": "jobs/big.toml"}
    assert kw["entrypoint_num_cpus"] == 1


def test_submit_job_outside_cwd_uploads_its_folder(tmp_path, monkeypatch, fake_client):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "j.yaml").write_text("")
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    submit_job(str(tmp_path / "elsewhere" / "j.yaml"), address="http://h:8265")
    working_dir = fake_client.kwargs["runtime_env"]["working_dir"]
    assert working_dir == str((tmp_path / "elsewhere").resolve())
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
