"""Warm-up of what fla tunes by token count: its gated norm keys its autotuning on
cdiv(rows, NORM_BUCKET_ROWS), so the engine's warm-up must reach every bucket a batch can."""

import pytest
import torch

from k3batch.model import K3Model, get_flavor
from k3kernels.kda import fla as kfla

pytest.importorskip("fla")


def _record(monkeypatch):
    import fla.modules.norm.fused_norm_gate as gate_mod

    seen = {"gate": []}
    monkeypatch.setattr(gate_mod, "rms_norm_gated",
                        lambda x, g, w, b, **kw: seen["gate"].append((x.shape, w.dtype)))  # fmt: skip
    return seen


@pytest.mark.parametrize("max_rows, buckets", [(8192 * 32, [1, 2, 3, 4]), (100, [1]),
                                               (kfla.NORM_BUCKET_ROWS + 1, [1, 2])])  # fmt: skip
def test_tune_norm_buckets_reaches_every_bucket(monkeypatch, max_rows, buckets):
    seen = _record(monkeypatch)
    kfla.tune_norm_buckets(max_rows, 128, torch.bfloat16, "cpu")
    for calls in seen.values():
        rows = [shape[0] for shape, _ in calls]
        assert [-(-r // kfla.NORM_BUCKET_ROWS) for r in rows] == buckets
        assert max(rows) <= max_rows and all(s[1] == 128 for s, _ in calls)
        assert all(dtype == torch.bfloat16 for _, dtype in calls)


def test_model_warm_up_tunes_the_kda_norms_at_its_heads(monkeypatch):
    config = get_flavor("kimi-linear-debug")
    model = K3Model(config, dtype=torch.bfloat16, device="cpu")
    calls = []
    monkeypatch.setattr(kfla, "tune_norm_buckets", lambda *a: calls.append(a))
    model.warm_up(8192)  # the torch backend tunes nothing
    assert calls == []
    model.set_backend("fla").warm_up(8192)
    H, K = config.kda_num_heads, config.kda_head_dim
    assert calls == [(8192 * H, K, torch.bfloat16, torch.device("cpu"))]
