"""Cluster descriptions: the GPU catalog agrees with the planner and the rooflines, presets and
files parse to the same clusters, links are picked by group size, and a bad file names its
field."""

import json

import pytest

from k3batch.bench.roofline import BF16_TFLOPS, COPY_TBPS
from k3batch.parallel import plan
from k3batch.sim.cluster import (
    GPUS,
    LINKS,
    ClusterSpec,
    GpuSpec,
    Link,
    cluster_from,
    derated,
    gpu_from_rates,
)


def test_gpu_catalog_reads_one_source_per_figure():
    assert {n: g.memory_bytes for n, g in GPUS.items()} == {
        n: int(b) for n, b in plan.GPUS.items()
    }
    h200 = GPUS["h200"]
    assert (h200.bf16_flops, h200.hbm_bytes_per_s) == (BF16_TFLOPS * 1e12, COPY_TBPS * 1e12)
    assert h200.source.startswith("measured here")
    assert all(GPUS[n].source.startswith("published") for n in ("h100", "b200", "gb300"))
    assert GPUS["h100"].fp4_flops is None and GPUS["gb300"].fp4_flops > GPUS["gb300"].bf16_flops


@pytest.mark.parametrize(
    "name, gpu, per_node, nodes, intra, inter",
    [
        ("h200x8", "h200", 8, 1, "nvlink4", "ib-ndr"),
        ("h200x8x4", "h200", 8, 4, "nvlink4", "ib-ndr"),
        ("h100x8x2", "h100", 8, 2, "nvlink4", "ib-ndr"),
        ("b200x8", "b200", 8, 1, "nvlink5", "ib-ndr"),
        ("gb300x4x2", "gb300", 4, 2, "nvlink5", "ib-xdr"),
        ("gb300-nvl72", "gb300", 72, 1, "nvlink5", "ib-xdr"),
    ],
)
def test_presets(name, gpu, per_node, nodes, intra, inter):
    c = cluster_from(name)
    assert (c.gpu.name, c.gpus_per_node, c.nodes, c.intra.name, c.inter.name) == (
        gpu, per_node, nodes, intra, inter
    )  # fmt: skip
    assert c.num_gpus == per_node * nodes
    assert c.lines()[0].startswith(f"cluster: {nodes} node")


def test_flags_replace_fields_of_a_preset_or_stand_alone():
    assert cluster_from("h200x8", nodes=2) == cluster_from("h200x8x2")
    assert cluster_from(gpu="h200") == cluster_from("h200x8")  # the planner's board size
    fast = Link(800e9, 1e-6, "fast")
    assert cluster_from("h100x8", intra=fast).intra == fast
    assert cluster_from("h100x8", inter="ib-xdr").inter == LINKS["ib-xdr"]


def test_link_by_group_size():
    c = cluster_from("h200x8x2")
    assert c.link(1) == c.link(8) == c.intra
    ring = c.link(16)  # 15 steps, 1 over the network
    assert ring.bytes_per_s == c.inter.bytes_per_s
    assert ring.latency_s == pytest.approx((14 * c.intra.latency_s + c.inter.latency_s) / 15)
    assert c.p2p_link(0, 7) == c.intra and c.p2p_link(7, 8) == c.inter
    with pytest.raises(ValueError, match="does not fit the cluster's 16"):
        c.link(17)


def test_toml_and_json_files(tmp_path):
    toml = tmp_path / "mine.toml"
    toml.write_text(
        "[cluster]\n"
        "gpus_per_node = 4\nnodes = 3\n"
        "[cluster.gpu]\n"
        'name = "x1"\nmemory_gb = 96\nbf16_tflops = 500\nhbm_tbps = 3\n'
        'source = "published: vendor sheet"\n'
        "[cluster.intra]\ngb_per_s = 300\nlatency_us = 1.5\n"
        '[cluster.inter]\nname = "ib-ndr"\nlatency_us = 8\n'
    )
    c = cluster_from(toml)
    assert c.gpu == GpuSpec("x1", 96_000_000_000, 500e12, None, 3e12, "published: vendor sheet")
    assert (c.gpus_per_node, c.nodes) == (4, 3)
    assert c.intra == Link(300e9, 1.5e-6, "intra")
    assert c.inter == Link(50e9, 8e-6, "ib-ndr")  # bandwidth from the named link
    js = tmp_path / "h200.json"
    js.write_text(json.dumps({"gpu": "h200", "nodes": 2}))
    assert cluster_from(str(js)) == cluster_from("h200x8x2")


@pytest.mark.parametrize(
    "text, message",
    [
        ('gpu = "h200"\nnode = 2\n', "unknown field.* node; expected gpu"),
        ('gpu = "h200"\nnodes = 0\n', "nodes = 0 must be a positive integer"),
        ('gpu = "h200"\nnodes = 1.5\n', "nodes = 1.5 must be a positive integer"),
        ('gpu = "a100"\n', "gpu = 'a100' unknown; known: h100, h200, b200, gb300"),
        ("nodes = 2\n", "field gpu is missing"),
        ('gpu = "h200"\nintra = "nvlink9"\n', "intra = 'nvlink9' unknown"),
        ('gpu = "h200"\n[inter]\nlatency_us = 5\n', "inter: field.* gb_per_s missing"),
        ('gpu = "h200"\n[inter]\ngb_per_s = "fast"\nlatency_us = 5\n', "gb_per_s = 'fast'"),
        ('gpu = "h200"\n[inter]\ngb_per_s = -1\nlatency_us = 5\n', "inter.bytes_per_s"),
        ('[gpu]\nname = "x"\nmemory_gb = 80\nbf16_tflops = 1\nhbm_tbps = 1\n',
         "gpus_per_node is missing"),
        ('gpus_per_node = 8\n[gpu]\nname = "x"\nmemory_gb = 80\nbf16_tflops = 1\nhbm_tbps = 1\n',
         "intra is missing: gpu 'x' has no default links"),
        ('[gpu]\nname = "x"\nmemory_gb = 80\n', "gpu: field.* bf16_tflops, hbm_tbps missing"),
        ('[gpu]\nname = "x"\nmemory_gb = 80\nbf16_tflops = 0\nhbm_tbps = 1\n',
         "bf16_tflops = 0 must be a positive number"),
        ('gpu = "h200"\nnodes = [\n', "not valid TOML"),
    ],
)  # fmt: skip
def test_a_bad_file_names_its_field(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as e:
        cluster_from(path)
    assert str(path) in str(e.value)


def test_bad_names():
    with pytest.raises(ValueError, match="unknown gpu 'a100'"):
        cluster_from("a100x8")
    with pytest.raises(ValueError, match="neither a preset"):
        cluster_from("eight-h200s")
    with pytest.raises(ValueError, match="does not exist"):
        cluster_from("no/such/cluster.toml")


def test_gpu_by_rates_and_derating():
    g = gpu_from_rates("mine", memory_gb=192, bf16_tflops=1300, hbm_tbps=5.3,
                       source="published: vendor")  # fmt: skip
    c = cluster_from(gpu=g, gpus_per_node=8, intra="nvlink4", inter="ib-ndr")
    assert isinstance(c, ClusterSpec) and c.gpu.memory_bytes == 192_000_000_000
    with pytest.raises(ValueError, match="hbm_tbps = -5 must be a positive number"):
        gpu_from_rates("bad", memory_gb=1, bf16_tflops=1, hbm_tbps=-5)
    assert derated(GPUS["h200"]) == GPUS["h200"]
    d = derated(GPUS["gb300"])
    assert d.bf16_flops == pytest.approx(2.5e15 * BF16_TFLOPS / 989)
    assert d.fp4_flops == pytest.approx(15e15 * BF16_TFLOPS / 989)
    assert d.hbm_bytes_per_s == pytest.approx(8e12 * COPY_TBPS / 4.8)
    assert d.memory_bytes == GPUS["gb300"].memory_bytes and "derated" in d.source
