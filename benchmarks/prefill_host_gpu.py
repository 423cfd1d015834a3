"""Where an eager prefill's wall time goes on one GPU: the host's time to enqueue one forward
against the GPU's time to run it, and every synchronizing call on the way (issue 54).

    source benchmarks/device_env.sh
    python3 benchmarks/prefill_host_gpu.py --flavor kimi-linear --experts mxfp4 --tokens 8192

One prefill of `--tokens` tokens (one sequence, no cache prefix) on random weights, after two
warm-ups: `enqueue_ms` is from the call to the return of `forward_batch` (the host's Python,
launches and any synchronization inside), `gpu_ms` from a CUDA event before the call to one
after it; wall_ms with the final synchronization. When enqueue_ms is close to wall_ms the host
bounds the prefill (launches or syncs), else the kernels do. `queued_gpu_ms`: the same span
with the whole forward enqueued behind a sleep kernel before its first kernel starts, so the
GPU never waits for the host: gpu_ms - queued_gpu_ms is the time the GPU idled inside the
forward waiting for launches ("queued": whether the host did finish enqueueing within the
sleep). Then the same forward under
`torch.cuda.set_sync_debug_mode("warn")`: each distinct place that synchronizes, with a count.
"""

import argparse
import collections
import json
import time
import traceback
import warnings

import torch

from k3batch.cache.layout import CacheLayout
from k3batch.cache.paged import PagedCache
from k3batch.model import K3Model, get_flavor
from k3batch.model.forward_batch import ForwardBatch
from k3batch.model.init import init_random_


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="kimi-linear")
    ap.add_argument("--experts", default="mxfp4", choices=["bf16", "mxfp4"])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seqs", type=int, default=1)
    args = ap.parse_args()
    config = get_flavor(args.flavor)
    model = K3Model(config, dtype=torch.bfloat16, device="cuda", expert_dtype=args.experts)
    init_random_(model, 0).eval().set_backend("fla")
    layout = CacheLayout.build(config, range(config.num_hidden_layers), page_size=64,
                               dtype_bytes=2)  # fmt: skip
    per = args.tokens // args.seqs
    cache = PagedCache(layout, args.seqs * layout.request_bytes(per + 1), device="cuda",
                       dtype=torch.bfloat16)  # fmt: skip
    pages = -(-(per + 1) // 64)
    batch = ForwardBatch(seq_lens=[per] * args.seqs, cached_lens=[0] * args.seqs,
                         slot_ids=list(range(args.seqs)),
                         page_tables=[list(range(i * pages, (i + 1) * pages))
                                      for i in range(args.seqs)])  # fmt: skip
    ids = torch.randint(0, config.vocab_size, (per * args.seqs,), device="cuda")

    def forward():
        with torch.inference_mode():
            return model.forward_batch(ids, batch, cache)

    for _ in range(2):
        forward()
    torch.cuda.synchronize()
    rows = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        forward()
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        rows.append({"enqueue_ms": 1e3 * (t1 - t0), "gpu_ms": start.elapsed_time(end),
                     "wall_ms": 1e3 * (t2 - t0)})  # fmt: skip
    best = min(rows, key=lambda r: r["wall_ms"])
    queued_ms, queued = queued_gpu_ms(forward, hold_ms=2 * best["enqueue_ms"] + 50)
    print(json.dumps({"flavor": args.flavor, "experts": args.experts, "tokens": args.tokens,
                      "seqs": args.seqs, **{k: round(v, 2) for k, v in best.items()},
                      "queued_gpu_ms": round(queued_ms, 2), "queued": queued}))  # fmt: skip
    sites = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-2] if "/k3batch/" in f.filename
                  or "/k3kernels/" in f.filename or "/fla/" in f.filename]  # fmt: skip
        where = " < ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in frames[::-1][:3])
        sites[f"{str(message)[:60]} @ {where}"] += 1

    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    forward()
    torch.cuda.set_sync_debug_mode("default")
    print(f"synchronizing calls in one forward: {sum(sites.values())}")
    for site, n in sites.most_common(20):
        print(f"{n:5d}  {site}")


def queued_gpu_ms(forward, hold_ms: float, repeats: int = 3) -> tuple[float, bool]:
    """(the best of `repeats` GPU times of forward() enqueued whole behind a sleep kernel of
    about hold_ms, whether every run's launches were all queued before the sleep ended)."""
    probe = 10**8  # cycles: the GPU's clock, measured, turns hold_ms into cycles
    for _ in range(2):  # the first launch of the sleep kernel also loads it: time the second
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        torch.cuda.synchronize()
    cycles = int(probe * hold_ms / start.elapsed_time(end))
    best, queued = float("inf"), True
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        forward()
        end.record()
        queued &= not start.query()  # the sleep still holds the stream: nothing ran yet
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end))
    return best, queued


if __name__ == "__main__":
    main()
