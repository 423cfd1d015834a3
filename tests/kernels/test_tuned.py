"""Tuned launch tables (`k3kernels.tuned`): the lookup order (the shape's entry at the nearest
size, then the regime's, then the kernel's defaults) on temporary files, `save` keeping the
other entries, and the committed H200 table: its k3-slice entries found at k3-slice's shapes,
Kimi Linear's shapes taking the H100's entries (the same SMs) until a sweep on an H200 saves
its own. CPU only:
the kernels are made to read a table by pointing `tuned.gpu_path` at one (on CPU and under
the interpreter they read none)."""

import json

import pytest
import torch
from k3kernels import tuned
from k3kernels.kda import chunk_state, conv_prefill
from k3kernels.kda import recurrent_decode as kda
from k3kernels.mla import decode as mla_decode
from k3kernels.mla import prefill as mla_prefill
from k3kernels.moe import grouped_gemm_triton as G

from k3batch.model import get_flavor

H200 = G.TUNED_DIR / "NVIDIA_H200.json"
A, B, C, R = ({"block_v": v, "num_warps": 4} for v in (16, 32, 64, 128))


def _write(path, tables: dict):
    path.write_text(json.dumps(tables))
    tuned.load.cache_clear()
    return path


def _gemm_keys(flavor: str, num_tokens: int) -> list[str]:
    """The tuned-table keys of a flavor's gate-up and down GEMMs at num_tokens tokens."""
    c = get_flavor(flavor)
    D, I, E = c.routed_expert_hidden_size or c.hidden_size, c.moe_intermediate_size, c.num_experts
    M = num_tokens * c.num_experts_per_token
    return [G.table_key(M, E, 2 * I, D), G.table_key(M, E, D, I)]


def test_keys_name_the_shape_and_a_power_of_two_size():
    assert tuned.size_class(1) == 1 and tuned.size_class(0) == 1
    assert [tuned.size_class(n) for n in (2, 3, 16, 17, 256)] == [2, 4, 16, 32, 256]
    assert _gemm_keys("kimi-linear", 8192) == ["prefill N=2048 K=2304 rows/expert=256",
                                               "prefill N=2304 K=1024 rows/expert=256"]  # fmt: skip
    # decode: 16 tokens x 8 / 256 experts = 0.5 rows an expert, 256 tokens 8
    assert _gemm_keys("kimi-linear", 16)[0] == "decode N=2048 K=2304 rows/expert=1"
    assert _gemm_keys("kimi-linear", 256)[1] == "decode N=2304 K=1024 rows/expert=8"
    assert _gemm_keys("k3-slice", 8192)[0] == "prefill N=6144 K=3584 rows/expert=256"
    assert mla_decode.table_key(16, 32, 512, 64, 16) == "H=32 L=512 R=64 page=16 batch=16"
    assert mla_prefill.table_key(8192, 32, 128, 64, 128) == "H=32 Dn=128 R=64 Dv=128 tokens=8192"
    assert kda.table_key(200, 32, 128, 128) == "H=32 K=128 V=128 batch=256"


def test_lookup_takes_the_shape_at_the_nearest_size_then_the_regime_then_nothing(tmp_path):
    path = _write(tmp_path / "GPU.json", {"t": {
        "decode H=1 batch=1": A, "decode H=1 batch=16": B, "decode H=1 batch=256": C,
        "decode H=2 rows=8": R, "decode": R}})  # fmt: skip

    def look(shape, n, *fallback):
        return tuned.lookup(path, "t", tuned.make_key(shape, "batch", n), fallback)

    assert look("decode H=1", 16) == B  # exact
    assert look("decode H=1", 2) == A and look("decode H=1", 6) == B  # 2 -> 1; 8 -> 16
    assert look("decode H=1", 4) == B  # 4 sits between 1 and 16: the tie goes to the larger
    assert look("decode H=1", 100_000) == C
    assert look("decode H=2", 8, "decode") == R  # another size name: not this shape's entry
    assert look("decode H=3", 16, "prefill", "decode") == R  # the first fallback present
    assert look("decode H=3", 16) == {}  # the kernel's defaults
    assert tuned.lookup(path, "other table", tuned.make_key("decode H=1", "batch", 1)) == {}
    assert tuned.lookup(None, "t", tuned.make_key("decode H=1", "batch", 1), ("decode",)) == {}
    assert tuned.lookup(path, "t", None, ("decode",)) == R


def test_a_gpu_with_the_same_sms_lends_its_shape_entries_before_any_fallback(tmp_path):
    """An H200 file without an entry of a shape takes the H100 file's entry of that shape
    (`SAME_SMS`), and only then a fallback key (its own first); its own entries come first."""
    h200 = _write(tmp_path / "NVIDIA_H200.json", {"t": {"decode H=1 batch=1": A, "decode": B}})
    _write(tmp_path / tuned.SAME_SMS["NVIDIA_H200.json"], {"t": {
        "decode H=1 batch=16": C, "decode H=2 batch=16": R, "prefill": R}})  # fmt: skip
    other = _write(tmp_path / "GPU.json", {"t": {"decode": B}})  # no GPU lends it entries

    def look(path, shape, *fallback):
        return tuned.lookup(path, "t", tuned.make_key(shape, "batch", 16), fallback)

    assert look(h200, "decode H=1", "decode") == A  # its own entry of the shape, at any size
    assert look(h200, "decode H=2", "decode") == R  # the H100's entry of the shape
    assert look(h200, "decode H=3", "decode") == B  # then its own fallback
    assert look(h200, "decode H=3", "prefill") == R  # the H100's fallback last
    assert look(other, "decode H=2", "decode") == B


def test_save_writes_its_key_and_keeps_every_other_entry(tmp_path):
    path = _write(tmp_path / "GPU.json", {"t": {"decode": A, "H=1 batch=1": B}, "u": {"x": C}})
    assert tuned.lookup(path, "t", "H=1 batch=16") == B  # read once: cached
    tuned.save(path, "t", "H=1 batch=16", R)
    tuned.save(tmp_path / "new" / "GPU.json", "t", "H=1 batch=16", R)  # a new file
    assert json.loads(path.read_text()) == {
        "t": {"H=1 batch=1": B, "H=1 batch=16": R, "decode": A}, "u": {"x": C}}
    assert list(json.loads(path.read_text())["t"]) == ["H=1 batch=1", "H=1 batch=16", "decode"]
    assert tuned.lookup(path, "t", "H=1 batch=16") == R  # the cache is cleared on save
    tuned.save(path, "t", "H=1 batch=16", A)  # saved again: replaced
    assert tuned.lookup(path, "t", "H=1 batch=16") == A
    assert json.loads((tmp_path / "new" / "GPU.json").read_text()) == {"t": {"H=1 batch=16": R}}


def test_tables_are_not_read_on_cpu_or_under_the_interpreter(tmp_path, monkeypatch):
    assert tuned.gpu_path(G.TUNED_DIR) is None  # this suite: CPU, TRITON_INTERPRET=1
    monkeypatch.setattr(tuned, "INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert tuned.gpu_path(tmp_path) == tmp_path / "NVIDIA_H200.json"
    monkeypatch.setattr(tuned, "INTERPRETED", True)
    assert tuned.gpu_path(tmp_path) is None


@pytest.fixture
def read_table(monkeypatch):
    """Kernels read the table at the given path as the current GPU's."""

    def use(path):
        monkeypatch.setattr(tuned, "gpu_path", lambda directory: path)
        tuned.load.cache_clear()

    yield use
    tuned.load.cache_clear()


def test_h200_table_has_k3_slice_entries_at_its_shapes_and_the_regime_fallbacks(read_table):
    """The MoE entries tuned at k3-slice before tables had shapes, kept as they were: under
    k3-slice's two GEMM shapes (prefill at 8,192 tokens, decode at 64) and as the regime
    fallbacks, so every size of k3-slice, and any shape without its own entry, still gets them."""
    read_table(H200)
    table = json.loads(H200.read_text())
    for weights in ("bf16", "mxfp4"):
        for regime, tokens in (("prefill", 8192), ("decode", 64)):
            for key in _gemm_keys("k3-slice", tokens):
                assert table[weights][key] == table[weights][regime], (weights, key)
    E = get_flavor("k3-slice").num_experts
    for tokens in (1, 16, 64, 256, 1024, 8192, 16384):
        M = 2 * tokens
        regime = G.regime(M, E)
        defaults = G.DEFAULT_CONFIGS[regime]
        no_tail = {k: v for k, v in defaults.items() if k != "block_t"}  # W4A16: table's only
        for nk in ((6144, 3584), (3584, 3072)):
            assert G.launch_config(M, E, "bf16", nk) == defaults | table["bf16"][regime]
            assert G.launch_config(M, E, "mxfp4", nk) == no_tail | table["mxfp4"][regime]
    assert G.launch_config(2, E, "torch.float32", nk=(6144, 3584)) == G.DEFAULT_CONFIGS["decode"]
    # Kimi Linear (256 experts, top-8) has no entries of its own on the H200: the H100's
    h100 = json.loads((G.TUNED_DIR / tuned.SAME_SMS[H200.name]).read_text())
    for tokens in (8192, 256, 16):
        for weights in ("bf16", "mxfp4"):
            for nk in ((2048, 2304), (2304, 1024)):
                key = G.table_key(8 * tokens, 256, *nk)
                assert key not in table[weights] and key in h100[weights]
                assert G.launch_config(8 * tokens, 256, weights, nk) | h100[weights][key] \
                    == G.launch_config(8 * tokens, 256, weights, nk)


def test_moe_launch_prefers_the_shape_entry_over_the_regime(tmp_path, read_table):
    """A sweep's entry for Kimi Linear's gate-up GEMM serves that GEMM at every decode size; its
    down GEMM and k3-slice keep the regime entry; a prefill size never takes a decode entry."""
    kimi = {"block_m": 16, "block_n": 128, "block_k": 64, "num_warps": 2, "num_stages": 3}
    tables = json.loads(H200.read_text())
    tables["mxfp4"]["decode N=2048 K=2304 rows/expert=8"] = kimi
    read_table(_write(tmp_path / "NVIDIA_H200.json", tables))
    E = 256
    for tokens in (1, 16, 64, 256):
        assert G.launch_config(8 * tokens, E, "mxfp4", nk=(2048, 2304)) == kimi
        assert G.launch_config(8 * tokens, E, "mxfp4", nk=(2304, 1024)) == tables["mxfp4"]["decode"]
    assert G.launch_config(8 * 8192, E, "mxfp4", nk=(2048, 2304)) == tables["mxfp4"]["prefill"]


def test_attention_launches_read_their_shape_entries(tmp_path, read_table):
    """MLA decode and prefill (bf16 only) and the KDA decode step take their shape's entry at
    the nearest size over their defaults, which they keep elsewhere."""
    dec = {"block_h": 32, "block_n": 16, "num_warps": 4, "num_stages": 3}
    pre = {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 2}
    read_table(_write(tmp_path / "NVIDIA_H200.json", {
        "decode": {mla_decode.table_key(64, 32, 512, 64, 16): dec,
                   kda.table_key(16, 32, 128, 128): {"block_v": 32, "num_warps": 2}},
        "prefill": {mla_prefill.table_key(8192, 32, 128, 64, 128): pre}}))  # fmt: skip
    assert mla_decode.launch_config(100, 32, 16) == dec
    assert mla_decode.launch_config(100, 32, 64) == mla_decode.default_config(32, 64)  # page
    fp32 = mla_decode.launch_config(100, 32, 16, dtype=torch.float32)
    assert fp32 == mla_decode.default_config(32, 16)
    assert mla_prefill.launch_config(4096, 32) == pre
    assert mla_prefill.launch_config(4096, 96)["block_m"] == mla_prefill.BLOCK_M
    assert kda.launch_config(1, 32) == {"block_v": 32, "num_warps": 2}
    assert kda.launch_config(1, 96) == {"block_v": kda.BLOCK_V, "num_warps": kda.NUM_WARPS}


def test_kda_prefill_launches_read_their_shape_entries(tmp_path, read_table):
    """The KDA short conv (by channels, width and parts) and the chunk recurrence (by heads and
    head dims) take their shape's entry at the nearest size; elsewhere the conv keeps its
    defaults and the chunk state its rule (`pick_block_v`)."""
    conv = {"block_t": 16, "block_c": 128, "num_warps": 8}
    state = {"block_v": 16, "num_warps": 8, "num_stages": 3}
    read_table(_write(tmp_path / "NVIDIA_H200.json", {
        "conv_prefill": {conv_prefill.table_key(8192, 12288, 4, 3, 2): conv},
        "chunk_state": {chunk_state.table_key(1, 32, 128, 128): state}}))  # fmt: skip
    assert conv_prefill.launch_config(6000, 12288, 4, 3, 2) == conv
    assert conv_prefill.launch_config(8192, 12288, 4, 1, 0) == dict(
        block_t=conv_prefill.BLOCK_T, block_c=conv_prefill.BLOCK_C,
        num_warps=conv_prefill.NUM_WARPS)  # another shape: the defaults
    cpu = torch.device("cpu")
    assert chunk_state.launch_config(2, 32, 128, 128, cpu) == state
    assert chunk_state.launch_config(1, 96, 128, 128, cpu) == dict(
        block_v=chunk_state.BLOCK_V, num_warps=chunk_state.NUM_WARPS,
        num_stages=chunk_state.NUM_STAGES)  # fmt: skip
