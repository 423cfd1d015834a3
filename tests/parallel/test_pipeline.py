"""Chunked pipeline-parallel prefill on Ray stage actors (gloo on CPU) against one device:
bit-identical logits and caches (torch.equal) for interleaved requests of different lengths,
with a chunk size that divides none of them; the default stage partition of K3_MINI
(k3batch.testing), which cuts at the boundary of its AttnRes blocks (pp = 2) and inside them."""

import pytest
import torch

from k3batch.actors.world import spawn_runners
from k3batch.engine.config import EngineConfig
from k3batch.engine.runner import LocalRunner
from k3batch.model.forward_batch import ForwardBatch
from k3batch.model.loader import load_model
from k3batch.parallel.layout import split_layers


def test_default_partition_follows_attn_res_blocks():
    sizes = lambda P: [b - a for a, b in split_layers(93, P, 12)]  # noqa: E731
    assert sizes(8) == [12] * 7 + [9]
    assert sizes(1) == [93] and sizes(93) == [1] * 93
    assert sizes(4) == [24, 24, 24, 21]
    assert sum(sizes(16)) == 93 and len(sizes(16)) == 16
    assert split_layers(27, 3, None) == [(0, 9), (9, 18), (18, 27)]
    assert split_layers(10, 2, None, sizes=[3, 7]) == [(0, 3), (3, 10)]
    with pytest.raises(ValueError, match="pp = 94"):
        split_layers(93, 94, 12)
    with pytest.raises(ValueError, match="summing to 93"):
        split_layers(93, 2, 12, sizes=[40, 40])


CFG = EngineConfig(max_num_seqs=3, max_seq_len=64, page_size=16)
PAGES = 4  # per request: 64 tokens


def _pages(i):
    return list(range(i * PAGES, (i + 1) * PAGES))


def _interleaved_batches(prompts, chunk):
    """Every request advances by up to `chunk` tokens per batch, all packed together
    (request i in block i and pages 4i..4i+3)."""
    done = [0] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):
        seqs = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        lens = [min(chunk, len(prompts[i]) - done[i]) for i in seqs]
        ids = [t for i, n in zip(seqs, lens) for t in prompts[i][done[i] : done[i] + n]]
        cached = [done[i] for i in seqs]
        tables = [_pages(i) for i in seqs]
        yield (
            ids,
            ForwardBatch(seq_lens=lens, cached_lens=cached, slot_ids=seqs, page_tables=tables),
        )
        for i, n in zip(seqs, lens):
            done[i] += n


@pytest.mark.parametrize(
    "pp",
    [
        2,
        4,
        # Slow (8 stage processes): pp = 4 runs the same roles (first, middle and last stages)
        # and cuts both inside and between AttnRes blocks.
        pytest.param(8, marks=pytest.mark.slow),
    ],
)
def test_pipeline_prefill_is_bit_identical(cluster, mini_model_dir, pp):
    g = torch.Generator().manual_seed(pp)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (13, 29, 7)]
    local = LocalRunner(load_model(mini_model_dir, dtype=torch.float32), CFG)
    runner, _ = spawn_runners(
        mini_model_dir, num_stages=pp, engine_config=CFG, device="cpu", dtype=torch.float32
    )
    try:
        batches = list(_interleaved_batches(prompts, chunk=5))
        handles = [runner.submit(ids, b, all_logits=True) for ids, b in batches]  # all in flight
        for (ids, b), h in zip(batches, handles):
            assert torch.equal(runner.wait(h), local.wait(local.submit(ids, b, all_logits=True)))
        for i, p in enumerate(prompts):
            got = runner.request_tensors(i, _pages(i), len(p))
            ref = local.cache.request_tensors(i, _pages(i), len(p))
            for name, layers in ref.items():
                assert sorted(got[name]) == sorted(layers)
                for layer, t in layers.items():
                    assert torch.equal(got[name][layer], t), (name, layer)
        stats = runner.bubble()
        assert len(stats["busy"]) == pp and 0 <= stats["bubble"] < 1
    finally:
        runner.shutdown()


def test_fill_benchmark_runs_and_teaching_model(cluster, mini_model_dir):
    from k3batch.bench.engine import format_fill_table, pipeline_fill, teaching_fill

    assert round(teaching_fill(5, 8), 3) == 0.417  # the blog's 5 chunks over 8 stages
    rows = pipeline_fill(
        mini_model_dir, num_stages=2, chunk_counts=[1, 3], chunk_tokens=4, device="cpu", repeats=1
    )
    assert [r["chunks"] for r in rows] == [1, 3]
    assert all(0 < r["fill"] <= 1 and len(r["busy"]) == 2 for r in rows)
    assert "teaching" in format_fill_table(rows, 2)
