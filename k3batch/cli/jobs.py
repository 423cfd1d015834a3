"""`k3batch submit/status/logs/stop`: Ray Jobs commands over k3batch.cli.submit.

`register(group)` adds them to the main click group. They read RAY_ADDRESS (the dashboard
address, http://HEAD:8265) and RAY_AUTH_TOKEN through click; the library reads no environment.
"""

from __future__ import annotations

import contextlib
import json
import sys

import click

_address_option = click.option(
    "--address",
    envvar="RAY_ADDRESS",
    show_envvar=True,
    required=True,
    help="Ray dashboard address, e.g. http://HEAD:8265.",
)
_token_option = click.option(
    "--token",
    envvar="RAY_AUTH_TOKEN",
    show_envvar=True,
    default=None,
    help="Cluster auth token, sent as a bearer token (see `ray get-auth-token`). "
    "Without it Ray sends ~/.ray/auth_token only when RAY_AUTH_MODE=token.",
)


@contextlib.contextmanager
def _user_errors():
    """Turn library and Ray client errors into one-line click errors (exit code 1)."""
    from ray.exceptions import AuthenticationError

    try:
        yield
    except (ValueError, TimeoutError, ConnectionError, RuntimeError, AuthenticationError) as e:
        raise click.ClickException(str(e)) from None


def _json_dict(value: str | None, flag: str) -> dict | None:
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"not JSON: {e}", param_hint=flag) from None
    if not isinstance(parsed, dict):
        raise click.BadParameter("must be a JSON object", param_hint=flag)
    return parsed


@click.command()
@click.argument("job", required=False, type=click.Path(exists=True, dir_okay=False))
@click.argument("extra_args", nargs=-1, type=click.UNPROCESSED)
@_address_option
@_token_option
@click.option(
    "--working-dir",
    type=click.Path(exists=True, file_okay=False),
    help="The job's working dir: relative paths in JOB start there, and of it only JOB and the "
    "files JOB reads are uploaded (default: current folder if it holds JOB).",
)
@click.option(
    "--max-upload-mib",
    type=click.FloatRange(min=0),
    default=100.0,
    show_default=True,
    help="Refuse to upload more (checkpoints and data belong on storage the cluster reads).",
)
@click.option("--runtime-env-json", default=None, help="Merged into the job's runtime_env.")
@click.option("--entrypoint-num-gpus", type=float, default=None, help="GPUs for the driver.")
@click.option("--entrypoint-num-cpus", type=float, default=None, help="CPUs for the driver.")
@click.option("--entrypoint-resources-json", default=None, help="Custom driver resources.")
@click.option("--submission-id", default=None)
@click.option(
    "--wait", is_flag=True, help="Stream logs until the job ends; exit 1 unless it succeeds."
)
@click.option("--no-check", is_flag=True, help="Do not load the spec locally before submitting.")
@click.option(
    "--entrypoint",
    "entrypoint_override",
    default=None,
    help="Run this shell command instead of `k3batch run JOB` (then omit JOB).",
)
def submit(
    job,
    extra_args,
    address,
    token,
    working_dir,
    max_upload_mib,
    runtime_env_json,
    entrypoint_num_gpus,
    entrypoint_num_cpus,
    entrypoint_resources_json,
    submission_id,
    wait,
    no_check,
    entrypoint_override,
):
    """Submit `k3batch run JOB` to a Ray cluster; print the submission id.

    Uploads JOB and the local files it reads (relative `model` and `input.path`), never
    dotfiles; absolute paths and URIs are read by the cluster itself. Arguments after `--` go
    to `k3batch run`: k3batch submit job.toml -- --model /ckpt
    """
    from k3batch.cli.submit import job_logs, submit_job, wait_for_job

    if (job is None) == (entrypoint_override is None):
        raise click.UsageError("give either JOB or --entrypoint")
    runtime_env = _json_dict(runtime_env_json, "--runtime-env-json")
    resources = _json_dict(entrypoint_resources_json, "--entrypoint-resources-json")
    with _user_errors():
        submission_id = submit_job(
            job,
            address=address,
            extra_args=extra_args,
            working_dir=working_dir,
            runtime_env=runtime_env,
            entrypoint_num_gpus=entrypoint_num_gpus,
            entrypoint_num_cpus=entrypoint_num_cpus,
            entrypoint_resources=resources,
            submission_id=submission_id,
            token=token,
            check_spec=not no_check,
            entrypoint_override=entrypoint_override,
            max_upload_bytes=int(max_upload_mib * (1 << 20)),
        )
    click.echo(submission_id)
    if not wait:
        return
    with _user_errors():
        try:
            for chunk in job_logs(submission_id, address=address, follow=True, token=token):
                click.echo(chunk, nl=False)
        except RuntimeError as e:  # the log stream dropped; the job goes on
            click.echo(f"log stream ended early ({e}); waiting for the job", err=True)
        status = wait_for_job(submission_id, address=address, token=token)
    click.echo(f"{submission_id} {status}")
    if status != "SUCCEEDED":
        sys.exit(1)


@click.command()
@click.argument("submission_id")
@_address_option
@_token_option
def status(submission_id, address, token):
    """Print the job's status: PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED."""
    from k3batch.cli.submit import job_status

    with _user_errors():
        click.echo(job_status(submission_id, address=address, token=token))


@click.command()
@click.argument("submission_id")
@_address_option
@_token_option
@click.option("--follow", "-f", is_flag=True, help="Keep streaming until the job ends.")
def logs(submission_id, address, token, follow):
    """Print the job's driver output."""
    from k3batch.cli.submit import job_logs

    with _user_errors():
        for chunk in job_logs(submission_id, address=address, follow=follow, token=token):
            click.echo(chunk, nl=False)


@click.command()
@click.argument("submission_id")
@_address_option
@_token_option
def stop(submission_id, address, token):
    """Ask Ray to stop the job."""
    from k3batch.cli.submit import stop_job

    with _user_errors():
        stopped = stop_job(submission_id, address=address, token=token)
    click.echo("stop requested" if stopped else "job had already ended")


def register(group: click.Group) -> None:
    """Add submit, status, logs and stop to `group` (the main `k3batch` group)."""
    for command in (submit, status, logs, stop):
        group.add_command(command)
