"""The seed's published K3 figures beside what the simulation predicts for them (issue 55):

    python -m k3batch.sim.seed [--calibration benchmarks/calibration_h100.jsonl] [--cluster gb300x4x2]

The seed measured K3 on "2x4 GB300" (read here as 2 nodes of 4 GB300, NVLink 5 inside a node,
InfiniBand XDR between: `cluster_from("gb300x4x2")`; `--cluster gb300-nvl72` puts all 8 on
NVLink). The inputs are the recorded calibration (`sim.records.recorded_tables`) carried to
the GB300 by its derated published peak rates (`sim.cluster.derated`: the fractions of the
datasheet that our H200 reaches), the communication model at the cluster's links, and the
engine on the virtual clock. Nothing is
fitted to the published numbers: a gap is explained by the model's terms in the table's notes.

1. 8K-token prefill, PP8 against TEP8. PP8: a stream of 8,192-token prompts through 8 pipeline
   stages (the engine's pipeline on the clock: each prompt one chunk, the AttnRes stream sent
   stage to stage), throughput = prompt tokens / time. TEP8 is not one of the engine's
   layouts: all 8 GPUs run every layer on their shard of heads and experts (the TP decode
   rank's model) and all-reduce after each layer; its time per prompt is `StepCost` at tp 8
   over every layer with its collectives. Published: 1.45-1.72x, 1.64x representative.
2. DCP8's logical context capacity against TP8 alone (`parallel.plan.make_plan`, the blog's
   formula): published about 1.5M -> 12.2M tokens (7.9x).
3. Decode with DCP8 at 48 agent sessions: TP8/DCP8 decode steps of 48 sequences, each holding
   an equal share of the DCP8 capacity (the published figure names no context; this is the
   assumption), tok/s = 48 / step. Published: 541 tok/s.
4. PP8 prefill into a TP8 decode group (PD disaggregated), MXFP4 experts, 8K in / 1K out: the
   job estimate of one pp8+tp8 replica (16 GPUs: twice the seed's 8, which names no split)
   at the engine's max_num_seqs and at 256.
   Published: 2,808 output tok/s per GPU at 18.7 tok/s per user.
"""

import argparse
import dataclasses

from k3batch.engine.config import EngineConfig
from k3batch.model.forward_batch import ForwardBatch
from k3batch.parallel.plan import make_plan
from k3batch.sim.calibration import Calibration
from k3batch.sim.cluster import cluster_from, derated
from k3batch.sim.cost import StepCost
from k3batch.sim.estimate import DEFAULT_TABLE, estimate_layout
from k3batch.sim.workload import Workload

PROMPT = 8192


def _prefill_batch(tokens: int) -> ForwardBatch:
    return ForwardBatch(seq_lens=[tokens], cached_lens=[0])


def pp_prefill(config, calibration, cluster, *, stages: int = 8, prompts: int = 32) -> dict:
    """Prefill tok/s of PP `stages`: the engine's pipeline on the clock, one chunk a prompt."""
    from k3batch.sim.estimate import run_replica

    plan = make_plan(config, gpu=cluster.gpu.name, pp_size=stages, tp_size=1, dcp_size=1,
                     context_len=PROMPT + 2, gpu_bytes=cluster.gpu.memory_bytes)  # fmt: skip
    work = Workload.fixed(prompts, PROMPT, 1)
    cfg = EngineConfig(chunk_size=PROMPT, max_batch_tokens=PROMPT, max_num_seqs=prompts)
    timed, _, clock = run_replica(config, plan, calibration, cluster, work, prompts,
                                  engine_config=cfg, pipeline_only=True)  # fmt: skip
    pp_s = max(t.finish_s for t in timed)
    return {"tok_s": prompts * PROMPT / pp_s,
            "stage_busy": {k: v / pp_s for k, v in clock.busy.items()}}  # fmt: skip


def tep_prefill(config, calibration, cluster, *, ranks: int = 8) -> dict:
    """Prefill tok/s of TEP `ranks`: every layer on a TP rank's share, with its collectives."""
    tep = StepCost(config, calibration, cluster, layer_ids=range(config.num_hidden_layers),
                   tp=ranks, dcp=1, embed=True, head=True)  # fmt: skip
    batch = _prefill_batch(PROMPT)
    seconds = tep.forward_s(batch)
    return {"tok_s": PROMPT / seconds, "comm_share": tep.comm_s(batch) / seconds}


def dcp_capacity(config, gpu: str, gpu_bytes: int, tp: int = 8) -> dict:
    plan = make_plan(config, gpu=gpu, pp_size=1, tp_size=tp, dcp_size=tp, gpu_bytes=gpu_bytes,
                     context_len=1 << 20)  # fmt: skip
    return {"tp": plan.capacity_tokens_no_dcp, "dcp": plan.capacity_tokens,
            "gain": plan.dcp_gain, "problems": plan.problems}  # fmt: skip


def sessions_decode(config, calibration, cluster, *, sessions: int = 48, tp: int = 8) -> dict:
    cap = dcp_capacity(config, cluster.gpu.name, cluster.gpu.memory_bytes, tp)["dcp"]
    context = cap // sessions
    cost = StepCost(config, calibration, cluster, layer_ids=range(config.num_hidden_layers),
                    tp=tp, dcp=tp, embed=True, head=True)  # fmt: skip
    batch = ForwardBatch(seq_lens=[1] * sessions, cached_lens=[context] * sessions)
    step = cost.forward_s(batch)
    return {"context": context, "step_s": step, "tok_s": sessions / step}


def pd_job(config, calibration, cluster, *, max_num_seqs: int = 0) -> dict:
    """One pp8+tp8 replica (16 GPUs: `cluster` doubled in nodes when it has fewer)."""
    if cluster.num_gpus < 16:
        cluster = dataclasses.replace(cluster, nodes=-(-16 // cluster.gpus_per_node))
    plan = make_plan(config, gpu=cluster.gpu.name, pp_size=8, tp_size=8, dcp_size=1,
                     context_len=PROMPT + 1024 + 1, gpu_bytes=cluster.gpu.memory_bytes)  # fmt: skip
    work = Workload.fixed(1_000_000, PROMPT, 1024)
    cfg = EngineConfig(chunk_size=PROMPT, max_num_seqs=max_num_seqs)
    row = estimate_layout(config, plan, calibration, cluster, work, engine_config=cfg)
    return {"tok_s_per_gpu": row.output_tok_s_per_gpu, "user_tok_s": row.user_tok_s,
            "max_num_seqs": row.max_num_seqs, "binds": row.binds, "why": row.why,
            "arena_requests": plan.max_requests, "gpus": plan.num_gpus}  # fmt: skip


def pd_gap(pd: dict) -> str:
    """The PD row's gap in the model's terms: how many sequences decode at once, published
    (tok/s per GPU x the seed's 8 GPUs / tok/s per user) against the engine's bound here."""
    published = 2808 * 8 / 18.7
    return (f"  gap: the published figures mean {published:,.0f} sequences decoding at once "
            f"(2,808 x 8 GPUs / 18.7); here at most max_num_seqs {pd['max_num_seqs']}, and the "
            f"TP8 group's arena holds {pd['arena_requests']:,} requests of {PROMPT + 1024:,} "
            f"tokens (the MLA latent whole on every rank without DCP); tok/s per GPU counts the "
            f"replica's {pd['gpus']} GPUs (prefill stages too); routed experts run as bf16 "
            f"GEMMs on unpacked MXFP4 (no FP4 tensor cores)")


def seed_table(calibration: Calibration, cluster_name: str = "gb300x4x2",
               pd_seqs: tuple[int, ...] = (0, 256)) -> list[str]:  # fmt: skip
    """The table's lines; pd_seqs: the max_num_seqs of the PD rows (0: the engine's own), each
    a job estimate of minutes on the CPU."""
    from k3batch.parallel.plan import checkpoint_config

    config = checkpoint_config("k3")
    cluster = cluster_from(cluster_name)
    cal = calibration.on(derated(cluster.gpu))
    out = [f"# python -m k3batch.sim.seed --cluster {cluster_name}", *cluster.lines(),
           f"calibration: {cal.source}", "",
           f"{'figure':<44} {'predicted':>12} {'published':>16}  ratio"]  # fmt: skip

    def row(what, predicted, published, ratio):
        out.append(f"{what:<44} {predicted:>12} {published:>16}  {ratio}")

    def missing(what, published, e: KeyError):
        row(what, "-", published, "N/A")
        out.append(f"  not predicted: {e.args[0]}")

    what = "8K prefill: PP8 / TEP8 throughput"
    pp = pp_prefill(config, cal, cluster)
    try:
        tep = tep_prefill(config, cal, cluster)
        ratio = pp["tok_s"] / tep["tok_s"]
        row(what, f"{ratio:.2f}x", "1.64x (1.45-1.72)", f"{ratio / 1.64:.2f}")
        out.append(f"  TEP8 {tep['tok_s']:,.0f} tok/s ({100 * tep['comm_share']:.0f}% of its "
                   "time in its all-reduces)")
    except KeyError as e:
        missing(what, "1.64x (1.45-1.72)", e)
    busy = ", ".join(f"{100 * v:.0f}%" for v in pp["stage_busy"].values())
    out.append(f"  PP8 {pp['tok_s']:,.0f} tok/s of 8K prompts, stages busy {busy}")
    cap = dcp_capacity(config, cluster.gpu.name, cluster.gpu.memory_bytes)
    row("logical capacity TP8 -> TP8/DCP8 (tokens)",
        f"{cap['tp'] / 1e6:.2f}M->{cap['dcp'] / 1e6:.1f}M", "1.5M -> 12.2M",
        f"{cap['gain'] / 7.9:.2f} (gain {cap['gain']:.2f}x vs 7.9x)")
    what = "DCP8 decode, 48 sessions (tok/s)"
    try:
        sd = sessions_decode(config, cal, cluster)
        row(what, f"{sd['tok_s']:,.0f}", "541", f"{sd['tok_s'] / 541:.2f}")
        out.append(f"  each session {sd['context']:,} tokens (assumed: an equal share of the "
                   f"DCP8 capacity), step {1e3 * sd['step_s']:.1f} ms")
    except KeyError as e:
        missing(what, "541", e)
    last = None
    for seqs in pd_seqs:
        what = f"PP8 -> TP8 decode, 8K/1K (tok/s/GPU), seqs {seqs or 'auto'}"
        try:
            pd = pd_job(config, cal, cluster, max_num_seqs=seqs)
        except KeyError as e:
            missing(what, "2,808", e)
            continue
        if pd["why"]:
            out.append(f"  pp8+tp8: {pd['why']}")
            continue
        row(what, f"{pd['tok_s_per_gpu']:,.0f}", "2,808", f"{pd['tok_s_per_gpu'] / 2808:.2f}")
        out.append(f"  per user {pd['user_tok_s']:.1f} tok/s (published 18.7); {pd['binds']}")
        last = pd
    if last is not None:
        out.append(pd_gap(last))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", default=str(DEFAULT_TABLE))
    ap.add_argument("--cluster", default="gb300x4x2")
    args = ap.parse_args()
    print("\n".join(seed_table(Calibration.load(args.calibration), args.cluster)))


if __name__ == "__main__":
    main()
