"""The benchmarks' procedures replayed on the virtual clock: what `bench engine`, `bench job`,
`bench layouts` and `bench pipeline` measure, measured again on simulated runners (`sim.clock`,
costed by `sim.cost` from a calibration table and the cluster's links), for `sim.validate`.
Each function follows its benchmark's own code step by step (the function says which) and
returns the same figures; the clock gives the times. No host time is spent (HostCost 0).
"""

import statistics
import tempfile
from pathlib import Path

import torch

from k3batch.bench.calibrate import CalibrateSpec, run_calibration
from k3batch.bench.engine import PREFILL_REPEATS
from k3batch.engine.config import GPU_BATCH_TOKENS, EngineConfig
from k3batch.engine.request import Phase, SamplingParams
from k3batch.model.forward_batch import ForwardBatch
from k3batch.parallel.layout import split_layers
from k3batch.sim.calibration import Calibration
from k3batch.sim.clock import SimPipeline, drive
from k3batch.sim.cost import LinkCost, StepCost, build_replica


def forward_shapes(clock) -> set[tuple[str, int, int]]:
    """(phase, tokens, sequences) of every forward on the clock."""
    return {(s.kind, sum(s.seq_lens), len(s.seq_lens)) for s in clock.trace
            if s.kind in ("prefill", "decode")}  # fmt: skip


def _prompts(gen, n: int, length: int, vocab: int) -> list[list[int]]:
    return [torch.randint(1, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def sim_engine(config, calibration, cluster, *, batch: int, prompt_len: int, new_tokens: int,
               chunk_size: int, experts: str, arena_bytes: int | None = None,
               overlap: bool = True, seed: int = 0) -> dict:  # fmt: skip
    """`bench engine`'s procedure (`engine_throughput`) on the simulated engine: its
    EngineConfig; PREFILL_REPEATS prefills of `batch` prompts generating one token each, timed
    from the step that admits them until none is in prefill, then a wait for the device
    (tokens/s from the median); one more prefill whose requests go on to the timed decode
    (step = decode time / (new_tokens - 1)). The warm-up (compilation) has nothing to simulate.
    Returns prefill_tok_s, decode_step_ms, per timed prefill (seconds, the forwards' summed
    seconds on the clock, engine steps), and the forwards' shapes."""
    cfg = EngineConfig(max_num_seqs=batch, max_seq_len=prompt_len + new_tokens + 1,
                       chunk_size=chunk_size, max_batch_tokens=max(chunk_size, GPU_BATCH_TOKENS),
                       overlap=overlap)  # fmt: skip
    engine, clock = build_replica(config, cfg, calibration, cluster, arena_bytes=arena_bytes,
                                  experts=experts)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)

    def sync():  # torch.cuda.synchronize: the host waits for everything submitted
        clock.advance_to(clock.end_s())

    def prefill(max_new_tokens):
        sp = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
        for i, ids in enumerate(_prompts(gen, batch, prompt_len, config.vocab_size)):
            engine.add_request(str(i), ids, sp)
        sync()
        t, first, steps = clock.now, len(clock.trace), 1
        engine.step()
        while any(r.phase is Phase.PREFILL for r in engine.running):
            engine.step()
            steps += 1
        sync()
        forwards = sum(s.end - s.start for s in clock.trace[first:] if s.kind == "prefill")
        if not forwards:
            raise ValueError(f"{batch} prompts of {prompt_len} tokens ran no forward: an arena "
                             f"of {arena_bytes} B holds none of them")  # fmt: skip
        return clock.now - t, forwards, steps

    runs = [prefill(1) for _ in range(PREFILL_REPEATS)]
    prefill(new_tokens)
    t = clock.now
    decode_steps = 0
    while engine.has_unfinished():
        engine.step()
        decode_steps += 1
    sync()
    return {
        "prefill_tok_s": batch * prompt_len / statistics.median(r[0] for r in runs),
        "decode_step_ms": 1e3 * (clock.now - t) / max(new_tokens - 1, 1),
        "prefill_runs": runs, "decode_steps": decode_steps,
        "max_num_seqs": engine.config.max_num_seqs, "shapes": forward_shapes(clock),
    }  # fmt: skip


def sim_job(config, calibration, cluster, row: dict, *, experts: str, seed: int = 0) -> dict:
    """`bench job`'s workload through one replica on the virtual clock, the engine configured
    as the job's (`bench.job.run_job_bench`: max_seq_len, chunk_size) and sized as the job's
    replica sized it (the row's `sizing`: max_num_seqs, max_batch_tokens, arena bytes).
    Returns output_tok_s over the run, seconds, engine steps, the forwards' shapes."""
    sizing = row.get("sizing") or {}
    cfg = EngineConfig(max_num_seqs=sizing.get("max_num_seqs", row.get("max_num_seqs", 0)),
                       max_seq_len=row["input_len"] + row["output_len"] + 1,
                       chunk_size=row.get("chunk_size", EngineConfig().chunk_size),
                       max_batch_tokens=sizing.get("max_batch_tokens", 0))  # fmt: skip
    arena = sizing["arena_bytes"][0] if sizing.get("arena_bytes") else None
    engine, clock = build_replica(config, cfg, calibration, cluster, arena_bytes=arena,
                                  experts=experts)  # fmt: skip
    sp = SamplingParams(temperature=0, max_new_tokens=row["output_len"], ignore_eos=True)
    gen = torch.Generator().manual_seed(seed)
    for i, ids in enumerate(_prompts(gen, row["num_prompts"], row["input_len"],
                                     config.vocab_size)):  # fmt: skip
        engine.add_request(str(i), ids, sp)
    timed = drive(engine, clock)
    tokens = sum(len(t.result.output_token_ids) for t in timed)
    steps = sum(1 for s in clock.trace if s.kind in ("prefill", "decode"))
    return {"output_tok_s": tokens / clock.now, "seconds": clock.now, "steps": steps,
            "max_num_seqs": engine.config.max_num_seqs,
            "shapes": forward_shapes(clock)}  # fmt: skip


def _chunks(prompt_len: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(chunk, prompt_len - s)) for s in range(0, prompt_len, chunk)]


def sim_pp_prefill(config, calibration, cluster, *, num_stages: int, prompt_len: int,
                   chunk_size: int, experts: str | None = None,
                   links: bool = True) -> dict:  # fmt: skip
    """One prompt of prompt_len tokens in chunks, submitted back to back through a
    `SimPipeline` of num_stages (`split_layers`), as `bench layouts` (`_pp_prefill`) and
    `bench pipeline` (`pipeline_fill`) do it; links: the stream's transfers at the cluster's
    link (`LinkCost`), else free. Returns seconds, the fill (1 - bubble), busy per stage, and
    the stream's seconds per chunk at the widest boundary."""
    ranges = split_layers(config.num_hidden_layers, num_stages, config.attn_res_block_size)
    costs = [StepCost(config, calibration, cluster, layer_ids=range(*r), embed=s == 0,
                      head=s == num_stages - 1, experts=experts)
             for s, r in enumerate(ranges)]  # fmt: skip
    link = LinkCost(config, cluster, ranges) if links and num_stages > 1 else None
    cfg = EngineConfig(max_num_seqs=1, max_seq_len=prompt_len + 1, chunk_size=chunk_size,
                       max_batch_tokens=chunk_size)  # fmt: skip
    pipe = SimPipeline(config, cfg, ranges, costs, stream_s=link and link.stream_s)
    pages = list(range(-(-prompt_len // cfg.page_size)))
    handles = [pipe.submit(None, ForwardBatch(seq_lens=[n], cached_lens=[start], slot_ids=[0],
                                              page_tables=[pages]), False)
               for start, n in _chunks(prompt_len, chunk_size)]  # fmt: skip
    for h in handles:
        pipe.wait(h)
    stats = pipe.bubble()
    one = ForwardBatch(seq_lens=[min(chunk_size, prompt_len)], cached_lens=[0])
    stream = max((link.stream_s(s, one) for s in range(num_stages - 1)), default=0.0) if link \
        else 0.0  # fmt: skip
    return {"seconds": pipe.clock.end_s(), "fill": 1 - stats["bubble"], "busy": stats["busy"],
            "stream_s_per_chunk": stream}  # fmt: skip


def sim_tp_prefill(config, calibration, cluster, *, tp: int, prompt_len: int, chunk_size: int,
                   experts: str | None = None) -> dict:  # fmt: skip
    """One prompt in chunks on one rank of a TP group holding every layer (`bench layouts`'
    `_tp_prefill`: not an engine layout), one forward after another: each chunk's calibrated
    parts at the tp shard plus its collectives. Returns seconds and the collectives' share."""
    cost = StepCost(config, calibration, cluster, layer_ids=range(config.num_hidden_layers),
                    tp=tp, embed=True, head=True, experts=experts)  # fmt: skip
    compute = comm = 0.0
    for start, n in _chunks(prompt_len, chunk_size):
        batch = ForwardBatch(seq_lens=[n], cached_lens=[start])
        compute, comm = compute + cost.compute_s(batch), comm + cost.comm_s(batch)
    return {"seconds": compute + comm, "comm_s": comm}


def sim_decode_step(config, calibration, cluster, *, tp: int, dcp: int, batch: int,
                    context_len: int, steps: int, experts: str | None = None) -> dict:  # fmt: skip
    """`bench layouts`' decode (`_decode`): `steps` steps of `batch` sequences at context_len
    + 2 + s cached tokens on one rank of TP tp / DCP dcp; the mean step's seconds and its
    collectives' share."""
    cost = StepCost(config, calibration, cluster, layer_ids=range(config.num_hidden_layers),
                    tp=tp, dcp=dcp, embed=True, head=True, experts=experts)  # fmt: skip
    batches = [ForwardBatch(seq_lens=[1] * batch, cached_lens=[context_len + 2 + s] * batch)
               for s in range(steps)]  # fmt: skip
    return {"seconds": statistics.mean(cost.forward_s(b) for b in batches),
            "comm_s": statistics.mean(cost.comm_s(b) for b in batches)}  # fmt: skip


def sim_handoff(config, cluster, *, num_tokens: int, tp: int = 1, dcp: int = 1) -> dict:
    """One request of num_tokens handed from a one-stage pipeline (all layers) to a decode
    group of tp ranks on the next GPUs: bytes all ranks receive and seconds (`LinkCost`)."""
    link = LinkCost(config, cluster, [(0, config.num_hidden_layers)], tp=tp, dcp=dcp)
    return {"bytes": sum(link.handoff_bytes(0, num_tokens)),
            "seconds": link.handoff_s(0, num_tokens)}  # fmt: skip


def cpu_calibration(flavor: str, *, chunk_tokens: int = 32, max_context: int = 1024,
                    log=lambda _: None) -> Calibration:  # fmt: skip
    """A CPU table of `flavor` measured here in seconds (`bench calibrate` at tp 1): prefill
    chunks of chunk_tokens and around, MLA after cached contexts up to max_context; dense
    experts; one thread (assumed for the recording's stage actors too: their thread counts were
    not recorded)."""
    spec = CalibrateSpec.for_device("cpu", flavor=flavor, tp=(1,), dcp=(1,),
                                    prefill_tokens=(chunk_tokens // 2, chunk_tokens,
                                                    2 * chunk_tokens),
                                    prefill_seqs=(1,), prefill_contexts=(max_context // 4,
                                                                         max_context),
                                    decode_batches=(1,), experts=("bf16",), repeats=5)  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "calibration_cpu.jsonl"
            run_calibration(spec, path, command="k3batch.sim.validate (CPU fill rows)", log=log)
            return Calibration.load(path)
    finally:
        torch.set_num_threads(threads)
