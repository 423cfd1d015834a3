"""The members of a disaggregated replica (prefill stages, decode ranks) under faults, on the
shared local Ray head: nothing waits without a bound, a dead member takes its replica down and
the replica is rebuilt, and per-actor memory is bounded.

Each test names the change that makes it fail on the code before issue 11."""

import os
import signal
import sys
import time

import pytest
import ray
import torch
from ray import cloudpickle
from ray.util.placement_group import placement_group, remove_placement_group

from k3batch.actors import prefill
from k3batch.actors.decode import DecodeRankActor
from k3batch.actors.failure import ReplicaFailed
from k3batch.actors.placement import Members, get_within, spawn_world
from k3batch.actors.prefill import PrefillStageActor
from k3batch.actors.replica import ReplicaActor
from k3batch.engine.config import EngineConfig
from k3batch.model.config import K3Config
from k3batch.parallel.layout import ParallelLayout

# The remote functions below travel by value: Ray's workers cannot import test modules.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

CFG = EngineConfig(max_num_seqs=2, max_seq_len=64, page_size=16)


@ray.remote(num_cpus=0)
def _sleep(seconds: float) -> None:
    time.sleep(seconds)


@ray.remote(num_cpus=0)
def _fail() -> None:
    raise ValueError("member failed")


def test_get_within_raises_the_first_error_and_names_who_is_late(cluster):
    """Old code: `ray.get(refs)` in PipelineRunner.wait / DecodeGroupRunner.wait, unbounded.
    Checked: with get_within reduced to `return ray.get(list(refs))`, no TimeoutError."""
    slow = _sleep.remote(60)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="member failed"):
        get_within([slow, _fail.remote()], 30, ["prefill stage 0", "prefill stage 1"])
    with pytest.raises(TimeoutError, match=r"prefill stage 0 within 1 s"):
        get_within([slow, _sleep.remote(0)], 1, ["prefill stage 0", "prefill stage 1"])
    assert time.monotonic() - t0 < 20
    ray.cancel(slow, force=True)


def test_spawn_world_gives_up_on_resources_that_never_come(cluster, mini_model_dir):
    """Old code: spawn_group's (now spawn_world's) `ray.get(actors[0].endpoint.remote())`
    waits forever here."""
    pg = placement_group([{"CPU": 1, "k3batch_no_such_device": 1}])
    kwargs = dict(model_dir=mini_model_dir, engine_config=CFG, device="cpu", dtype=torch.float32)
    kwargs |= dict(layer_range=(0, 2), num_stages=1, rank=0)
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError) as err:
            spawn_world(
                [Members(actor_cls=PrefillStageActor, kwargs=[kwargs], role="prefill stage")],
                device="cpu",
                placement_group=pg,
                timeout_s=2,
            )
    finally:
        remove_placement_group(pg)
    assert time.monotonic() - t0 < 30
    msg = str(err.value)
    assert "prefill stage 0" in msg and "k3batch_no_such_device" in msg, msg


def test_stage_busy_intervals_are_bounded(mini_model_dir, monkeypatch):
    """Old code: `self.busy` was a list that grew by one interval per chunk, forever.
    Checked: with `deque()` for `deque(maxlen=BUSY_WINDOW)`, 5 intervals are kept."""
    monkeypatch.setattr(prefill, "BUSY_WINDOW", 2)
    layers = K3Config.from_hf(mini_model_dir).num_hidden_layers
    stage = PrefillStageActor(
        mini_model_dir,
        (0, layers),
        rank=0,
        num_stages=1,
        engine_config=CFG,
        device="cpu",
        dtype=torch.float32,
    )
    meta = dict(seq_lens=[3], cached_lens=[0], slot_ids=[0], page_tables=[[0, 1, 2, 3]])
    for _ in range(5):
        stage.forward([5, 6, 7], meta, all_logits=False)
    assert len(stage.stats()["busy"]) == 2


def test_stage_warms_up_its_layers_for_its_largest_batch(mini_model_dir, monkeypatch):
    """A pipeline stage tunes what its kernels tune by batch size before its first batch, as
    the single-device runner does (fla's gated norm on a GPU, tens of launches a new bucket).
    Checked: without the stage's `warm_up` call, `calls` stays empty."""
    from k3batch.model import K3Model

    calls = []
    monkeypatch.setattr(K3Model, "warm_up", lambda self, tokens: calls.append(tokens))
    layers = K3Config.from_hf(mini_model_dir).num_hidden_layers
    PrefillStageActor(mini_model_dir, (1, layers), rank=1, num_stages=2, engine_config=CFG,
                      device="cpu", dtype=torch.float32)  # fmt: skip
    assert calls == [CFG.batch_tokens(False)]


def test_decode_rank_refuses_to_decode_after_a_lost_handoff(cluster, mini_model_dir):
    """Old code: a failed import_request (nobody waits for it) left the rank decoding from a
    cache without the request: silently wrong tokens instead of a replica rebuild.
    Checked: without the `if self.broken` check in forward, the call goes on into the model."""
    rank = DecodeRankActor(
        mini_model_dir,
        ParallelLayout(tp_size=2),
        tp_rank=1,
        engine_config=CFG,
        device="cpu",
        dtype=torch.float32,
    )
    with pytest.raises(ValueError, match="member failed"):
        rank.import_request(0, [0], [_fail.remote()])
    with pytest.raises(RuntimeError, match="decode rank 1: importing a request"):
        rank.forward([1], dict(seq_lens=[1], cached_lens=[1]), all_logits=False)


def _members(replica) -> dict[tuple[str, int], int]:
    members = ray.get(replica.members.remote(), timeout=BUILD_TIMEOUT_S)
    return {(m["role"], m["rank"]): m["pid"] for m in members}


# Bounds for building a replica (processes that import torch): seconds on an idle machine,
# minutes on a loaded 2-core one.
BUILD_TIMEOUT_S = 600


def _wait_failed(replica, timeout_s: float = 60) -> ReplicaFailed:
    """The replica noticed that a member died: its calls raise ReplicaFailed, naming it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(replica.ready.remote(), timeout=10)
        except ReplicaFailed as e:
            return e
        time.sleep(0.5)
    raise AssertionError(f"the replica did not notice within {timeout_s} s")


def _wait_rebuilt(replica, old_pid: int, timeout_s: float = BUILD_TIMEOUT_S) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            info = ray.get(replica.ready.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ReplicaFailed):
            time.sleep(0.5)
            continue
        if info["pid"] != old_pid:
            return info
        time.sleep(0.5)
    raise AssertionError(f"replica not rebuilt within {timeout_s} s")


def test_dead_stage_or_rank_rebuilds_its_idle_replica(cluster, mini_model_dir):
    """A disaggregated replica (a prefill stage and a decode rank, the fewest processes with
    both kinds of member) with no work: SIGKILL the decode rank, then the prefill stage; each
    time the replica notices (its calls raise ReplicaFailed naming the member) and, restarted
    as the driver restarts it (`ray.kill(no_restart=False)`), comes back with all-new members.
    Old code: no watchdog (and no `members`): an idle replica never noticed a dead member.
    Checked: with the watchdog's thread start in ReplicaActor.__init__ disabled, this
    fails with "the replica did not notice"."""
    actor = ray.remote(ReplicaActor).options(num_cpus=0, max_restarts=2, max_task_retries=0)
    replica = actor.remote(mini_model_dir, CFG, "cpu", disaggregate=True)
    try:
        pid = ray.get(replica.ready.remote(), timeout=BUILD_TIMEOUT_S)["pid"]
        for victim in [("decode", 0), ("prefill", 0)]:
            before = _members(replica)
            assert set(before) == {("prefill", 0), ("decode", 0), ("replica", 0)}
            os.kill(before[victim], signal.SIGKILL)
            failed = _wait_failed(replica)
            label = {"decode": "decode rank 0", "prefill": "prefill stage 0"}[victim[0]]
            assert failed.details["where"] == label, failed.details
            ray.kill(replica, no_restart=False)
            pid = _wait_rebuilt(replica, pid)["pid"]
            after = _members(replica)
            assert not set(before.values()) & set(after.values()), (before, after)
    finally:
        ray.kill(replica)
