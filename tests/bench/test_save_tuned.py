"""`--sweep --save-tuned` without a GPU: what `bench moe` and the attention kernel benches
write into a tuned table (`k3kernels.tuned`), given sweep rows as they print them; their sweep
grids; and the CLI refusing --save-tuned without --sweep."""

import json

import pytest
import torch
from click.testing import CliRunner
from k3kernels import tuned
from k3kernels.kda import chunk_state, conv_prefill
from k3kernels.kda import recurrent_decode as kda
from k3kernels.mla import decode as mla_decode
from k3kernels.mla import prefill as mla_prefill
from k3kernels.moe import grouped_gemm_triton as G

from k3batch.bench import kernels, moe
from k3batch.cli import main


@pytest.fixture
def gpu_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    yield
    tuned.load.cache_clear()


def test_moe_save_best_writes_both_gemms_of_the_flavor(tmp_path, monkeypatch, gpu_named):
    monkeypatch.setattr(G, "TUNED_DIR", tmp_path)
    old = {"decode": {"block_m": 16}, "decode N=6144 K=3584 rows/expert=2": {"block_m": 16}}
    (tmp_path / "NVIDIA_H200.json").write_text(json.dumps({"mxfp4": old, "bf16": old}))
    fast = {"block_m": 16, "block_n": 128, "block_k": 64, "num_warps": 2, "num_stages": 3}
    slow = fast | {"block_k": 256}
    rows = [{"impl": "gemm-mxfp4", "ms": 0.5},  # the pass's own GEMM: not a swept config
            {"impl": f"gemm-mxfp4 {json.dumps(slow)}", "ms": 2.0},
            {"impl": f"gemm-mxfp4 {json.dumps(fast)}", "ms": 1.0},
            {"impl": f"gemm-mxfp4 {json.dumps(fast | {'num_warps': 8})}", "error": "OOR"}]
    saved = moe.save_best(rows, "mxfp4", "kimi-linear", 256)
    assert saved["config"] == fast and saved["path"] == str(tmp_path / "NVIDIA_H200.json")
    keys = ["decode N=2048 K=2304 rows/expert=8", "decode N=2304 K=1024 rows/expert=8"]
    assert saved["keys"] == keys
    table = json.loads((tmp_path / "NVIDIA_H200.json").read_text())
    assert table["bf16"] == old and table["mxfp4"] == old | dict.fromkeys(keys, fast)
    with pytest.raises(ValueError, match="no swept config ran"):
        moe.save_best(rows[:1], "mxfp4", "kimi-linear", 256)


@pytest.mark.parametrize("name,module", [("mla-decode", mla_decode), ("mla-prefill", mla_prefill),
                                         ("kda-decode", kda), ("kda-conv", conv_prefill),
                                         ("kda-chunk-state", chunk_state)])  # fmt: skip
def test_kernel_save_best_writes_the_results_key(tmp_path, monkeypatch, gpu_named, name, module):
    monkeypatch.setattr(module, "TUNED_DIR", tmp_path)
    table = kernels.TABLES[name][1]
    (tmp_path / "NVIDIA_H200.json").write_text(json.dumps({table: {"other": {"x": 1}}}))
    result = {"key": "H=32 batch=16", "launch": {"num_warps": 4}, "sweep": [{"ms": 1.0}]}
    assert kernels.save_best(name, result) == tmp_path / "NVIDIA_H200.json"
    assert json.loads((tmp_path / "NVIDIA_H200.json").read_text()) == {
        table: {"H=32 batch=16": {"num_warps": 4}, "other": {"x": 1}}}
    with pytest.raises(ValueError, match="no swept launch ran"):
        kernels.save_best(name, result | {"sweep": []})


def test_sweep_grids_hold_valid_launches():
    for decode in (True, False):
        for cfg in moe.sweep_configs(decode, bf16=False):  # W4A16: `grouped_mm_mxfp4`'s checks
            assert cfg["block_k"] % 32 == 0 and cfg.get("block_t", 0) < cfg["block_m"]
    bf16 = moe.sweep_configs(False, bf16=True)
    assert len({json.dumps(c) for c in bf16}) == len(bf16)
    assert {"block_m": 128, "block_t": 0} in [{k: c[k] for k in ("block_m", "block_t")}
                                              for c in bf16]  # fmt: skip
    for fold in ("gather", "act"):  # each tile in and out of the GEMM's folded passes
        assert any(c.get(fold) for c in bf16) and not all(c.get(fold) for c in bf16)
    for heads, page in ((32, 16), (96, 64), (12, 16)):  # the rule's tile is among those swept
        assert mla_decode.default_config(heads, page) in kernels.mla_decode_tiles(heads)


@pytest.mark.parametrize("bench", ["mla-decode", "mla-prefill", "kda-decode", "kda-prefill", "moe"])
def test_save_tuned_needs_a_sweep(bench):
    out = CliRunner().invoke(main, ["bench", bench, "--save-tuned"])
    assert out.exit_code == 2 and "--save-tuned needs --sweep" in out.output


def test_kernel_benches_take_several_sizes():
    out = CliRunner().invoke(main, ["bench", "mla-decode", "--batch", "1,16,64",
                                    "--context-len", "8192,1024"])  # fmt: skip
    assert out.exit_code == 2 and "2 context lengths for 3 batches" in out.output
    out = CliRunner().invoke(main, ["bench", "kda-decode", "--batch", "1,x"])
    assert out.exit_code == 2 and "expected integers, comma-separated" in out.output
