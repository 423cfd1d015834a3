"""`k3batch bench host`: the engine's host side alone. The job's schedule (prompts of one
length, greedy, a fixed number of new tokens) runs through a real `Engine` whose runner
computes nothing (`sim.clock.SimRunner` at zero cost: a GPU's single-device runner with CUDA
graphs): it keeps the accounting of a device arena of the given size (admission, prefix cache
and checkpoints, eviction, page tables, the overlapped decode's bookkeeping) and returns zero
logits. The time per step is what the host adds to each step; the device hides it while the
host's part is the shorter (the overlapped decode; prefill steps queued ahead), and bounds the
step when it is not (`sim.clock.HostCost` takes these figures). Zero logits of a small
vocabulary (`vocab_size`) keep the CPU's sampling out of the figures. With `profile`, the top
functions by cumulative time (cProfile, which slows the host ~2x)."""

import cProfile
import dataclasses
import io
import pstats
import time

import torch

from k3batch.engine.config import EngineConfig
from k3batch.engine.engine import Engine
from k3batch.engine.request import Phase, SamplingParams
from k3batch.model import get_flavor
from k3batch.sim.clock import SimRunner


def host_replay(flavor: str = "k3-slice", *, num_prompts: int, input_len: int, output_len: int,
                arena_gib: float, vocab_size: int = 4096, seed: int = 0,
                profile: bool = False, metrics: bool = False) -> dict:  # fmt: skip
    """Host milliseconds per prefill and per decode step of the schedule (see module doc).
    metrics: record the replica's metrics as the job's replica does (`k3batch.metrics`: a
    histogram value per step, the sampling thread beside it), on a local Ray started here."""
    config = dataclasses.replace(get_flavor(flavor), vocab_size=vocab_size)
    engine_config = EngineConfig(max_seq_len=input_len + output_len + 1)
    runner = SimRunner(config, engine_config, lambda batch: 0.0,
                       arena_bytes=int(arena_gib * 2**30), vocab_size=vocab_size)  # fmt: skip
    engine = Engine(None, runner=runner)
    gen = torch.Generator().manual_seed(seed)
    sampling = SamplingParams(temperature=0, max_new_tokens=output_len, ignore_eos=True)
    for i in range(num_prompts):
        prompt = torch.randint(1, vocab_size, (input_len,), generator=gen).tolist()
        engine.add_request(str(i), prompt, sampling)
    on_step = None
    if metrics:
        import ray

        from k3batch.metrics import ReplicaMetrics

        if not ray.is_initialized():
            ray.init(address="local", num_cpus=1, include_dashboard=False)
        on_step = ReplicaMetrics(engine, job="bench-host", replica="0").step
    spent = {"prefill": [0.0, 0], "decode": [0.0, 0]}
    metrics_s = 0.0  # inside the metrics' call of each step
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    while engine.has_unfinished():
        prefill = any(r.phase is Phase.PREFILL for r in engine.running) or bool(
            engine.waiting and len(engine.running) < engine.config.max_num_seqs)
        t = time.perf_counter()
        engine.step()
        if on_step is not None:
            t_metrics = time.perf_counter()
            on_step(engine.last_step_prefill, t_metrics - t)
            metrics_s += time.perf_counter() - t_metrics
        kind = spent["prefill" if prefill else "decode"]
        kind[0] += time.perf_counter() - t
        kind[1] += 1
    if prof:
        prof.disable()
    row = {"flavor": flavor, "num_prompts": num_prompts, "input_len": input_len,
           "output_len": output_len, "arena_gib": arena_gib,
           "max_num_seqs": engine.config.max_num_seqs, "profiled": profile, "metrics": metrics,
           "total_s": round(time.perf_counter() - t0, 2)}  # fmt: skip
    for kind, (seconds, steps) in spent.items():
        row[f"{kind}_steps"] = steps
        row[f"{kind}_host_ms_per_step"] = round(1000 * seconds / max(steps, 1), 2)
    if metrics:
        steps = sum(n for _, n in spent.values())
        row["metrics_us_per_step"] = round(1e6 * metrics_s / max(steps, 1), 2)
    row["cache"] = dataclasses.asdict(engine.pool.stats)
    if prof:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
        row["profile"] = out.getvalue()
    return row
