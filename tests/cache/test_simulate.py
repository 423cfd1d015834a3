"""The decode-pool simulator: exact against a step-by-step oracle, nothing lost, deterministic,
and the unified pool admits where a static split of the same bytes waits."""

from collections import deque

import pytest

from k3batch.cache.arena import ArenaSpec
from k3batch.cache.layout import CacheLayout
from k3batch.cache.manager import CacheManager
from k3batch.cache.simulate import Request, make_workload, simulate, static_split
from k3batch.model.config import get_flavor

# k3-debug layers 0..7 (6 KDA, 2 MLA): block 16,896 B, page of 16 tokens 2,560 B.
LAYOUT = CacheLayout.build(get_flavor("k3-debug"), range(8), page_size=16, dtype_bytes=2)
POOL_BYTES = 400_000
SCALE = {"short_prompt": (16, 64), "long_prompt": (256, 1024), "output": (8, 64)}


def _workload(name: str, seed: int = 0, num_requests: int = 80) -> list[Request]:
    return make_workload(name, num_requests=num_requests, seed=seed, **SCALE)


def _static_blocks(dcp_size: int = 1) -> int:
    return static_split(POOL_BYTES, LAYOUT, context_len=256, dcp_size=dcp_size)


def _step_by_step(workload, *, static_blocks, max_num_seqs, dcp_size=1) -> dict:
    """The simulator's rules one step at a time, without strides or an event heap: the oracle."""
    spec = ArenaSpec(
        total_bytes=POOL_BYTES, block_bytes=LAYOUT.block_bytes, page_bytes=LAYOUT.page_bytes
    )
    mgr = CacheManager(
        [spec], page_size=LAYOUT.page_size, static_blocks=static_blocks, dcp_size=dcp_size
    )
    pending = deque(sorted(range(len(workload)), key=lambda i: (workload[i].arrival_step, i)))
    queue, running = deque(), {}  # running: request -> tokens decoded, oldest first
    out = [0] * len(workload)
    step = failures = retractions = lost = conc_sum = use_sum = 0
    while not all(out):
        while pending and workload[pending[0]].arrival_step <= step:
            queue.append(pending.popleft())
        while queue and len(running) < max_num_seqs:
            if mgr.admit(str(queue[0]), (), workload[queue[0]].prompt_len) is None:
                assert running, "the oracle's workload must fit an empty pool"
                failures += 1
                break
            running[queue.popleft()] = 0
        for i in list(running):
            position = workload[i].prompt_len + running.get(i, 0)
            while i in running and not mgr.grow(str(i), position + 1):
                youngest = list(running)[-1]
                mgr.release(str(youngest))
                lost += running.pop(youngest)
                queue.appendleft(youngest)
                retractions += 1
        conc_sum += len(running)
        use_sum += mgr.arena.used_bytes()[0]
        for i in list(running):
            running[i] += 1
            if running[i] == workload[i].output_len:
                mgr.release(str(i))
                out[i] = running.pop(i)
        step += 1
    return {
        "steps": step,
        "admission_failures": failures,
        "retractions": retractions,
        "lost_tokens": lost,
        "peak_used_bytes": mgr.stats.peak_used_bytes[0],
        "mean_concurrency": conc_sum / step,
        "mean_use": use_sum / step / POOL_BYTES,
        "output_lens": tuple(out),
    }


CASES = {  # id: (workload, num_requests, static?, max_num_seqs, dcp_size)
    "short-heavy-80-static": ("short-heavy", 80, True, 64, 1),
    "short-heavy-80-unified": ("short-heavy", 80, False, 64, 1),
    "long-heavy-80-unified": ("long-heavy", 80, False, 64, 1),
    "mixed-bursts-400-static": ("mixed-bursts", 400, True, 64, 1),  # idle gaps between bursts
    "mixed-bursts-400-unified-seqs8": ("mixed-bursts", 400, False, 8, 1),
    "long-heavy-80-unified-dcp2": ("long-heavy", 80, False, 64, 2),
}


@pytest.mark.parametrize("name, num, static, max_num_seqs, dcp_size", CASES.values(), ids=CASES)
def test_simulate_matches_step_by_step(name, num, static, max_num_seqs, dcp_size):
    workload = _workload(name, num_requests=num)
    blocks = _static_blocks(dcp_size) if static else None
    result = simulate(
        workload,
        layout=LAYOUT,
        pool_bytes=POOL_BYTES,
        mode="static" if static else "unified",
        static_blocks=blocks,
        max_num_seqs=max_num_seqs,
        dcp_size=dcp_size,
    )
    oracle = _step_by_step(
        workload, static_blocks=blocks, max_num_seqs=max_num_seqs, dcp_size=dcp_size
    )
    assert {k: getattr(result, k) for k in oracle} == oracle
    decoded = result.tokens_per_step * result.steps + result.lost_tokens
    assert decoded == pytest.approx(result.mean_concurrency * result.steps)


def test_simulate_retracts_under_pressure():
    """The oracle comparison above must cover retractions (its long-heavy unified case)."""
    result = simulate(_workload("long-heavy"), layout=LAYOUT, pool_bytes=POOL_BYTES, mode="unified")
    assert result.retractions > 0 and result.lost_tokens > 0


@pytest.mark.parametrize("name", ["short-heavy", "mixed-bursts"])
def test_unified_pool_waits_less_than_static_split(name):
    workload = _workload(name)
    static = simulate(
        workload,
        layout=LAYOUT,
        pool_bytes=POOL_BYTES,
        mode="static",
        static_blocks=_static_blocks(),
    )
    unified = simulate(workload, layout=LAYOUT, pool_bytes=POOL_BYTES, mode="unified")
    assert unified.admission_failures < static.admission_failures
    assert unified.mean_concurrency > static.mean_concurrency
    assert unified.steps < static.steps
    for r in (static, unified):  # nothing lost: every request ends with its full output
        assert r.output_lens == tuple(q.output_len for q in workload)
        assert r.peak_used_bytes <= POOL_BYTES and r.peak_concurrency <= 256


def test_simulate_is_deterministic():
    assert _workload("mixed-bursts", seed=3) == _workload("mixed-bursts", seed=3)
    assert _workload("mixed-bursts", seed=3) != _workload("mixed-bursts", seed=4)
    kw = {"layout": LAYOUT, "pool_bytes": POOL_BYTES, "mode": "unified"}
    assert simulate(_workload("long-heavy", seed=3), **kw) == simulate(
        _workload("long-heavy", seed=3), **kw
    )


def test_simulate_one_request_by_hand():
    """Prompt 30, 5 output tokens, arriving at step 2: it decodes on steps 2..6; its pages
    cover 32 tokens, then one more page at position 32 (step 4)."""
    result = simulate([Request(2, 30, 5)], layout=LAYOUT, pool_bytes=POOL_BYTES, mode="unified")
    assert result.steps == 7 and result.output_lens == (5,)
    assert result.peak_used_bytes == LAYOUT.block_bytes + 3 * LAYOUT.page_bytes
    assert result.mean_concurrency == pytest.approx(5 / 7)
    assert result.admission_failures == result.retractions == 0


def test_simulate_rejects_bad_arguments():
    kw = {"layout": LAYOUT, "pool_bytes": POOL_BYTES}
    with pytest.raises(ValueError, match="mode"):
        simulate([], mode="paged", **kw)
    with pytest.raises(ValueError, match="static_blocks"):
        simulate([], mode="static", **kw)
    with pytest.raises(ValueError, match="output_len"):
        simulate([], mode="unified", **kw)
    with pytest.raises(ValueError, match="output_len"):
        simulate([Request(0, 10, 0)], mode="unified", **kw)
    with pytest.raises(ValueError, match="does not fit"):
        simulate([Request(0, 10**6, 1)], mode="unified", **kw)
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("huge", num_requests=1, seed=0)
