"""The files in cluster/ work with the job specs in jobs/: the launcher YAML passes Ray's own
cluster-config validator (the JSON schema Ray ships), the KubeRay manifests parse and name only
files and clusters that exist, and every GPU job spec matches a node type that each cluster
file declares (its accelerator type, and as many GPUs per node as the spec plans with)."""

import re
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from k3batch.driver.jobspec import load_job_spec

ROOT = Path(__file__).resolve().parents[1]
GPU_JOBS = [p for p in sorted((ROOT / "jobs").glob("*.toml"))
            if load_job_spec(p).replicas.resolved_device == "cuda"]  # fmt: skip


def _launcher() -> dict:
    return yaml.safe_load((ROOT / "cluster" / "ray-cluster.yaml").read_text())


def _kuberay(name: str) -> list[dict]:
    return list(yaml.safe_load_all((ROOT / "cluster" / name).read_text()))


def _launcher_node_types() -> dict[str, dict]:
    """node type -> {"accelerator_type", "gpus"} of the launcher's GPU node types."""
    out = {}
    for name, t in _launcher()["available_node_types"].items():
        res = t.get("resources", {})
        accel = [k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")]
        if res.get("GPU"):
            out[name] = {"accelerator_type": accel[0] if accel else None, "gpus": res["GPU"]}
    return out


def _kuberay_node_types() -> dict[str, dict]:
    (cluster,) = _kuberay("kuberay-raycluster.yaml")
    out = {}
    for group in cluster["spec"]["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        gpus = int(container["resources"]["limits"].get("nvidia.com/gpu", 0))
        # rayStartParams.resources is a quoted JSON string, as `ray start --resources` takes it
        declared = yaml.safe_load(yaml.safe_load(group["rayStartParams"].get("resources", '""')))
        accel = [k.split(":", 1)[1] for k in declared or {} if k.startswith("accelerator_type:")]
        if gpus:
            out[group["groupName"]] = {"accelerator_type": accel[0] if accel else None,
                                       "gpus": gpus}  # fmt: skip
    return out


def test_launcher_yaml_passes_rays_cluster_config_validator():
    # What `ray up` does: fill in the provider's defaults, then validate against the schema
    validate_config(prepare_config(_launcher()))  # raises on a violation
    assert _launcher_node_types(), "no GPU node type"


def test_launcher_validator_rejects_a_broken_config():
    config = _launcher()
    config["available_node_types"]["h200_x8"]["max_workers"] = "four"
    with pytest.raises(Exception, match="four"):
        validate_config(prepare_config(config))


def test_kuberay_manifests_parse_and_name_what_exists():
    (cluster,) = _kuberay("kuberay-raycluster.yaml")
    (job,) = _kuberay("kuberay-rayjob.yaml")
    assert cluster["kind"] == "RayCluster" and job["kind"] == "RayJob"
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    named = re.findall(r"\bjobs/[\w.-]+\.(?:toml|ya?ml)\b", job["spec"]["entrypoint"])
    assert named, job["spec"]["entrypoint"]
    for path in named:
        assert (ROOT / path).is_file(), f"the RayJob runs {path}, which does not exist"
        load_job_spec(ROOT / path)  # and it parses
    assert _kuberay_node_types(), "no GPU worker group"


@pytest.mark.parametrize("job", GPU_JOBS, ids=[p.stem for p in GPU_JOBS])
@pytest.mark.parametrize("source", ["ray-cluster.yaml", "kuberay-raycluster.yaml"])
def test_each_gpu_job_matches_a_declared_node_type(job, source):
    r = load_job_spec(job).replicas
    types = _launcher_node_types() if source == "ray-cluster.yaml" else _kuberay_node_types()
    fits = [name for name, t in types.items() if t["gpus"] == r.gpus_per_node
            and (r.accelerator_type is None or t["accelerator_type"] == r.accelerator_type)]  # fmt: skip
    assert fits, (
        f"{job.name}: accelerator_type = {r.accelerator_type!r}, gpus_per_node = "
        f"{r.gpus_per_node}; {source} declares {types}"
    )


def _metric_names() -> set[str]:
    """Every k3batch_ metric the code defines (`k3batch/metrics.py`), as Prometheus scrapes it:
    ray_ before, _total after a counter's name."""
    import ast

    src = (ROOT / "k3batch" / "metrics.py").read_text()
    names = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("Counter", "Gauge",
                                                                          "Histogram"):  # fmt: skip
            name = f"ray_{node.args[0].value}"
            names.add(name + "_total" if node.func.id == "Counter" else name)
    return names


def test_grafana_dashboard_uses_exactly_the_exported_metrics():
    import json

    dash = json.loads((ROOT / "cluster" / "grafana_k3batch.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|count|sum)$", "", n) for e in exprs
            for n in re.findall(r"ray_k3batch_\w+", e)}  # fmt: skip
    defined = _metric_names()
    assert len(defined) == 17, defined
    assert used == defined, (used - defined, defined - used)
    assert all('job=~"$job"' in e for e in exprs)


def test_kuberay_pods_are_scraped_on_the_metrics_export_port():
    (cluster,) = _kuberay("kuberay-raycluster.yaml")
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    for group in groups:
        port = group["rayStartParams"]["metrics-export-port"]
        notes = group["template"]["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/port"] == port
        (container,) = group["template"]["spec"]["containers"]
        assert {"containerPort": int(port), "name": "metrics"} in container["ports"]
    launcher = yaml.safe_dump(_launcher())
    assert launcher.count("--metrics-export-port=8080") == 2
