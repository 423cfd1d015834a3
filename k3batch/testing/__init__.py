"""Test helpers shared by the test suites: numerical comparison with stated tolerances, logit
agreement metrics, a small table of measured numbers for reports, and K3_MINI, the small model
of the tests whose checks do not depend on depth. `k3batch.testing.simcluster` holds the tests'
multi-node Ray clusters (and the elastic benchmark's autoscaling one).

`assert_close` is the one way tests compare floating-point tensors: it checks for NaN/inf
first, computes the relative RMS error and the max absolute error, logs both, and raises
`AssertionError` with both numbers when either exceeds its tolerance (never a warning).
"""

import dataclasses
import json
import logging
import math
from pathlib import Path

import torch

from k3batch.model.config import get_flavor

log = logging.getLogger(__name__)

# k3-debug's layer schedule in miniature: 9 layers (KDA, KDA, KDA, MLA, twice, then MLA) in
# AttnRes blocks of 4, so the last block is partial and the model ends in two MLA layers, as
# k3-debug's 93 layers (7 blocks of 12, then 9; MLA at 92 and 93) do. For the tests whose checks
# (exact equality, or tolerances that a shallower model only tightens) do not depend on depth:
# the prefix cache, the pipeline, the TP/DCP groups, replica faults and whole jobs; a forward
# costs a tenth of k3-debug's. Pipeline cuts: pp = 2 at the block boundary, pp = 4 inside too.
K3_MINI = dataclasses.replace(
    get_flavor("k3-debug"),
    num_hidden_layers=9,
    kda_layers=(1, 2, 3, 5, 6, 7),
    full_attn_layers=(4, 8, 9),
    attn_res_block_size=4,
)


def assert_close(name: str, ref, out, *, rel_rms: float, max_abs: float | None = None) -> dict:
    """Compare `out` against the reference `ref` (same shape, any float dtypes).

    rel_rms: bound on rms(out - ref) / rms(ref); max_abs: optional bound on max |out - ref|.
    Returns {"name", "rel_rms", "max_abs", "rel_rms_tol", "max_abs_tol"}.
    """
    if tuple(ref.shape) != tuple(out.shape):
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    for label, t in (("output", out), ("reference", ref)):
        bad = ~torch.isfinite(t)
        if bad.any():
            idx = bad.nonzero()[0].tolist()
            raise AssertionError(
                f"{name}: {label} has {int(bad.sum())} non-finite values (first at {idx})"
            )
    r, o = ref.detach().double().cpu(), out.detach().double().cpu()
    diff = o - r
    err_rms = diff.pow(2).mean().sqrt().item() if diff.numel() else 0.0
    ref_rms = r.pow(2).mean().sqrt().item() if r.numel() else 0.0
    if ref_rms > 0:
        rel = err_rms / ref_rms
    else:
        rel = 0.0 if err_rms == 0 else math.inf
    mx = diff.abs().max().item() if diff.numel() else 0.0
    metrics = {
        "name": name,
        "rel_rms": rel,
        "max_abs": mx,
        "rel_rms_tol": rel_rms,
        "max_abs_tol": max_abs,
    }
    log.info("%s: rel_rms %.3e (tol %.1e), max_abs %.3e (tol %s)", name, rel, rel_rms, mx, max_abs)
    if rel > rel_rms or (max_abs is not None and mx > max_abs):
        err = AssertionError(
            f"{name}: rel_rms {rel:.3e} (tol {rel_rms:.1e}), max_abs {mx:.3e} "
            f"(tol {max_abs if max_abs is not None else 'none'})"
        )
        err.metrics = metrics  # so that a report can still record the measured numbers
        raise err
    return metrics


def logit_agreement(ref_logits, out_logits) -> dict:
    """Agreement of two logit tensors [..., V] over all leading positions: mean KL(ref || out)
    in nats (fp64 softmax), top-1 agreement, and the relative RMS error of the logits."""
    r = ref_logits.detach().double().cpu().reshape(-1, ref_logits.shape[-1])
    o = out_logits.detach().double().cpu().reshape(-1, out_logits.shape[-1])
    lp_r, lp_o = torch.log_softmax(r, -1), torch.log_softmax(o, -1)
    kl = (lp_r.exp() * (lp_r - lp_o)).sum(-1)
    top1 = (r.argmax(-1) == o.argmax(-1)).double().mean().item()
    rel = ((o - r).pow(2).mean().sqrt() / r.pow(2).mean().sqrt()).item()
    return {"kl_mean": kl.mean().item(), "kl_max": kl.max().item(), "top1": top1, "rel_rms": rel}


class MetricsTable:
    """Rows of measured numbers (a name plus any of rel_rms, max_abs, kl_mean, top1, ...),
    printed as a fixed-width table.

    With `json_path`, every added row is merged at once into that JSON file, shaped
    `{section: {row name: metrics}}`, under an exclusive file lock: several test modules and
    several pytest-xdist workers can share one report file, and a run cut short still leaves
    the numbers it measured.
    """

    COLUMNS = (
        "ok",
        "rel_rms",
        "rel_rms_tol",
        "max_abs",
        "kl_mean",
        "kl_max",
        "top1",
        "route_agree",
    )

    def __init__(self, section: str, json_path: str | Path | None = None):
        self.section = section
        self.json_path = Path(json_path) if json_path else None
        self.rows: list[dict] = []

    def add(self, row_name: str, **metrics) -> dict:
        row = {"name": row_name} | {k: v for k, v in metrics.items() if k != "name"}
        self.rows.append(row)
        if self.json_path is not None:
            self._merge_row(row)
        return row

    def check(self, name: str, ref, out, *, rel_rms: float, max_abs: float | None = None) -> dict:
        """`assert_close` that records its numbers in the table, failed or not."""
        try:
            m = assert_close(name, ref, out, rel_rms=rel_rms, max_abs=max_abs)
        except AssertionError as e:
            self.add(name, **getattr(e, "metrics", {}), ok=False)
            raise
        self.add(name, **m, ok=True)
        return m

    def format(self) -> str:
        width = max([len(r["name"]) for r in self.rows] + [4])
        head = f"{'name':<{width}}  " + "  ".join(f"{c:>11}" for c in self.COLUMNS)
        lines = [f"== {self.section}", head]
        for r in self.rows:
            cells = []
            for c in self.COLUMNS:
                v = r.get(c)
                if v is None:
                    cells.append(f"{'-':>11}")
                elif isinstance(v, bool):
                    cells.append(f"{'yes' if v else 'NO':>11}")
                else:
                    cells.append(f"{v:>11.4g}")
            lines.append(f"{r['name']:<{width}}  " + "  ".join(cells))
        return "\n".join(lines)

    @classmethod
    def load_all(cls, json_path: str | Path) -> list["MetricsTable"]:
        """The tables stored in a report file, one per section, rows sorted by name."""
        data = json.loads(Path(json_path).read_text())
        tables = []
        for section, rows in data.items():
            t = cls(section)
            t.rows = [{"name": n} | m for n, m in sorted(rows.items())]
            tables.append(t)
        return tables

    def _merge_row(self, row: dict) -> None:
        import fcntl  # POSIX only, like the GPU hosts; imported here to keep import cheap

        path = self.json_path
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                data = json.loads(path.read_text()) if path.is_file() else {}
            except json.JSONDecodeError:
                data = {}
            section = data.setdefault(self.section, {})
            section[row["name"]] = {k: v for k, v in row.items() if k != "name"}
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(data, indent=1))
            tmp.replace(path)


def slot_cache(config, layer_ids, *, num_slots: int, max_seq_len: int, device, dtype,
               page_size: int = 16, tp_size: int = 1, dcp_size: int = 1):  # fmt: skip
    """A PagedCache with room for num_slots requests of max_seq_len tokens, laid out as fixed
    slots: slot s owns KDA block s and pages `slot_pages(s, ...)` (see `slot_batch`). For
    tests that drive a model or a rank directly, without an engine."""
    from k3batch.cache.layout import CacheLayout
    from k3batch.cache.paged import PagedCache

    layout = CacheLayout.build(
        config, layer_ids, page_size=page_size, dtype_bytes=dtype.itemsize, tp_size=tp_size
    )
    total = num_slots * layout.request_bytes(max_seq_len, dcp_size)
    cache = PagedCache(layout, total, device=device, dtype=dtype, dcp_size=dcp_size)
    cache.pages_per_slot = layout.request_pages(max_seq_len, dcp_size)
    return cache


def slot_pages(cache, slot: int) -> list[int]:
    n = cache.pages_per_slot
    return list(range(slot * n, (slot + 1) * n))


def slot_batch(cache, seq_lens, cached_lens, slots, **kw):
    """A ForwardBatch addressing the fixed slots of a `slot_cache`."""
    from k3batch.model.forward_batch import ForwardBatch

    tables = [slot_pages(cache, s) for s in slots]
    return ForwardBatch(
        seq_lens=list(seq_lens), cached_lens=list(cached_lens), slot_ids=list(slots),
        page_tables=tables, **kw,
    )  # fmt: skip


def slot_tensors(cache, slot: int, num_tokens: int) -> dict:
    """A slot's request tensors (see `PagedCache.request_tensors`)."""
    return cache.request_tensors(slot, slot_pages(cache, slot), num_tokens)


def truncated_checkpoint(src: str, dst: Path) -> Path:
    """A copy of the checkpoint folder `src` at `dst` whose largest safetensors shard is cut to
    half its bytes, as a broken download leaves it (the fault tests' bad checkpoint)."""
    dst.mkdir(parents=True)
    for f in Path(src).iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    shard = max(dst.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return dst


def random_prompts(lens, seed: int = 0, prefix=()) -> list[list[int]]:
    """Prompts of the given lengths (after a shared `prefix`) of ids drawn from [0, 500)."""
    g = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(0, 500, (n,), generator=g).tolist() for n in lens]


def batch_key(batch) -> tuple:
    """A ForwardBatch's schedule (lengths, cached lengths, KDA blocks, page tables), comparable."""
    return (tuple(batch.seq_lens), tuple(batch.cached_lens), tuple(batch.slot_ids),
            tuple(map(tuple, batch.page_tables)))  # fmt: skip
