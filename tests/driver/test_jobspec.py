"""Job specs are checked by type before anything starts (k3batch/driver/jobspec.py).

Fails before the fix: the dataclasses took any value, so `batch_rows = "4"` reached
`validate()` as a str and raised TypeError there (`"4" < 1`), and `num_replicas = 1.5` passed
validation and failed inside Ray (drop the `check_types(...)` call in `JobSpec.validate` and in
`job_spec_from_dict` and these tests fail).
"""

import dataclasses
import json

import pytest
from click.testing import CliRunner

from k3batch.cli import main
from k3batch.driver.jobspec import (
    InputSpec,
    JobSpec,
    ReplicaSpec,
    job_spec_from_dict,
    load_job_spec,
)
from k3batch.model import get_flavor


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A checkpoint folder with only its config.json: all that validate() reads."""
    path = tmp_path_factory.mktemp("ckpt")
    (path / "config.json").write_text(json.dumps(get_flavor("k3-debug").to_hf()))
    return str(path)


BAD_FIELDS = [
    # (section, field, value, words the message must hold)
    ("input", "batch_rows", "4", ["input.batch_rows", "'4'", "valid integer"]),
    ("input", "batch_rows", 4.0, ["input.batch_rows", "valid integer"]),
    ("input", "prompt_column", 3, ["input.prompt_column", "valid string"]),
    ("output", "logprobs", "yes", ["output.logprobs", "valid boolean"]),
    ("sampling", "temperature", "0.7", ["sampling.temperature", "valid number"]),
    ("sampling", "temperature", float("nan"), ["sampling.temperature", "finite"]),
    ("sampling", "seed", 1.5, ["sampling.seed", "valid integer"]),
    ("sampling", "top_k", True, ["sampling.top_k", "valid integer"]),
    ("sampling", "stop_token_ids", [1, "2"], ["sampling.stop_token_ids.1", "valid integer"]),
    ("replicas", "num_replicas", 1.5, ["replicas.num_replicas", "1.5", "valid integer"]),
    ("replicas", "device", "gpu", ["replicas.device", "'auto', 'cpu' or 'cuda'"]),
    ("replicas", "pp_layers", [2.5, 3], ["replicas.pp_layers.0", "valid integer"]),
    ("replicas", "wait_timeout_s", "10m", ["replicas.wait_timeout_s", "valid number"]),
    ("engine", "memory_pool", "paged", ["engine.memory_pool", "'unified' or 'static'"]),
    ("engine", "prefix_cache", 1, ["engine.prefix_cache", "valid boolean"]),
    ("engine", "cache_bytes", 1e9, ["engine.cache_bytes", "valid integer"]),
]


@pytest.mark.parametrize(
    "section, name, value, words", BAD_FIELDS, ids=[f"{s}.{n}={v!r}" for s, n, v, _ in BAD_FIELDS]
)
def test_spec_rejects_wrong_type_naming_field(section, name, value, words):
    with pytest.raises(ValueError) as err:
        job_spec_from_dict({section: {name: value}}, source="job.toml")
    for w in ["job.toml", *words]:
        assert w in str(err.value)


def test_spec_accepts_toml_shapes():
    """Lists for tuples, ints for floats: what TOML and YAML give."""
    spec = job_spec_from_dict(
        {
            "model": "m",
            "sampling": {"stop_token_ids": [1, 2], "temperature": 1},
            "replicas": {"pp_layers": [3, 3], "num_gpus": 2, "wait_timeout_s": 30},
            "engine": {"memory_fraction": 0.5},
        }
    )
    assert spec.sampling.stop_token_ids == (1, 2) and spec.replicas.pp_layers == (3, 3)
    assert spec.replicas.num_gpus == 2 and spec.replicas.wait_timeout_s == 30
    assert spec.input == InputSpec()  # untouched sections keep their defaults


LAYOUTS = [
    # (replicas fields, GPU bundles after the coordinator's, decode group)
    ({}, None, False),
    ({"pp": 2}, 2, False),
    ({"tp": 2}, 3, True),
    ({"disaggregate": True}, 2, True),  # 1 prefill stage + 1 decode rank
    ({"pp": 2, "tp": 2}, 4, True),
    ({"pp": 2, "tp": 2, "disaggregate": True}, 4, True),
]


@pytest.mark.parametrize("fields, workers, decode", LAYOUTS, ids=[str(f) for f, *_ in LAYOUTS])
def test_replica_bundles_hold_every_stage_and_decode_rank(fields, workers, decode):
    from k3batch.driver.replicas import replica_bundles

    r = job_spec_from_dict({"replicas": {**fields, "device": "cuda"}}).replicas
    assert r.has_decode_group is decode
    bundles, strategy = replica_bundles(r, "cuda")
    if workers is None:  # single device: one bundle, the replica actor with its GPU
        assert bundles == [{"CPU": 1, "GPU": 1}]
    else:  # the coordinator, then one GPU per stage and per decode rank
        assert bundles == [{"CPU": 1}] + [{"CPU": 1, "GPU": 1}] * workers
    assert strategy == "STRICT_PACK"


def test_validate_checks_types_of_a_python_built_spec(model_dir, tmp_path):
    spec = JobSpec(
        model=model_dir,
        input=InputSpec(path=str(tmp_path), batch_rows="4"),
        replicas=ReplicaSpec(num_replicas=1.5),
    )
    spec = dataclasses.replace(spec, output=dataclasses.replace(spec.output, path=str(tmp_path)))
    with pytest.raises(ValueError) as err:
        spec.validate()
    assert "input.batch_rows = '4'" in str(err.value)
    assert "replicas.num_replicas = 1.5" in str(err.value)
    spec = dataclasses.replace(spec, input=InputSpec(path="i"), replicas=ReplicaSpec())
    spec = dataclasses.replace(spec, replicas=ReplicaSpec(wait_timeout_s=0))
    with pytest.raises(ValueError, match="wait_timeout_s = 0"):
        spec.validate()


@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
def test_cli_run_refuses_bad_spec_before_starting(model_dir, tmp_path, suffix):
    """`k3batch run` stops with a one-line error (no traceback, no Ray)."""
    fields = {"model": model_dir, "input": {"path": "i", "batch_rows": "4"}}
    fields["output"] = {"path": "o"}
    path = tmp_path / f"job{suffix}"
    if suffix == ".toml":
        toml = '[input]\npath = "i"\nbatch_rows = "4"\n[output]\npath = "o"\n'
        path.write_text(f'model = "{model_dir}"\n{toml}')
    else:
        path.write_text(json.dumps(fields))  # JSON is YAML
    result = CliRunner().invoke(main, ["run", str(path)])
    assert result.exit_code == 1, result.output
    assert "input.batch_rows = '4' (str): Input should be a valid integer" in result.output
    assert "Traceback" not in result.output
    with pytest.raises(ValueError, match="input.batch_rows"):
        load_job_spec(path)


def test_inflight_rows_follow_the_engine():
    """0 (the default): twice the engine's max_num_seqs, at least 64; where the engine sizes
    max_num_seqs on a GPU, twice its most (256)."""
    from k3batch.engine.config import EngineConfig
    from k3batch.driver.jobspec import JobSpec, ReplicaSpec

    assert JobSpec().inflight_rows == 64  # CPU: 8 sequences
    gpu = ReplicaSpec(device="cuda")
    assert JobSpec(replicas=gpu).inflight_rows == 512
    assert JobSpec(replicas=gpu, engine=EngineConfig(max_num_seqs=100)).inflight_rows == 200
    assert JobSpec(replicas=ReplicaSpec(max_inflight_rows=5)).inflight_rows == 5
