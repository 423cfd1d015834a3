"""Progress line and final report of a batch job.

The progress line goes to stderr: rewritten in place on a terminal, one line every 10 s
otherwise. The report is printed and saved as JSON beside the output (`REPORT_NAME`).
"""

import sys
import time
from dataclasses import asdict, dataclass, field

from k3batch.actors.serve import account_line

REPORT_NAME = "_k3batch_report.json"


@dataclass
class JobReport:
    job: str
    output: str
    rows_total: int | None = None  # from the input footers; None when a footer is unreadable
    rows_skipped_resumed: int = 0  # rows already committed by an earlier run
    rows_written: int = 0  # rows committed by this run
    rows_with_error: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    unreadable_inputs: list[str] = field(default_factory=list)  # files/regions skipped, why
    # Rows of the input with no output after this run, per file: {"file", "rows" (None:
    # unknown), "batches", "why"}; empty when every input row has an output row.
    missing: list[dict] = field(default_factory=list)
    replica_failures: int = 0
    rows_retried: int = 0
    # rows retried uncharged: their replica's node went away, or the verdict on its failure was
    # still open (`driver.health`: charged, and taken off here, if it turns out its own)
    rows_moved: int = 0
    replica_moves: dict[str, int] = field(default_factory=dict)  # "preempted"/"drained"/"lost"
    failures_unjudged: int = 0  # replica failures whose verdict was still open at the end
    replica_timeline: list[tuple[float, int]] = field(default_factory=list)  # (s, replicas up)
    rows_per_replica: list[int] = field(default_factory=list)
    peak_open_units: int = 0  # units held in driver memory at once (bounded by design)
    peak_inflight_rows: int = 0  # rows dispatched to one replica and not yet returned
    pipeline: list[dict] = field(default_factory=list)  # per replica with pp > 1: busy, bubble
    # per replica with a decode group: its handoffs (`handoff_line`)
    decode_groups: list[dict] = field(default_factory=list)
    cache: list[dict] = field(default_factory=list)  # per replica: memory and prefix-cache counters
    sizing: list[dict] = field(default_factory=list)  # per replica: `Engine.sizing`
    # per replica: where its engine thread's time went (`actors.serve.StepAccount.to_dict`)
    engine_steps: list[dict] = field(default_factory=list)
    started_at: float = 0.0  # Unix time of the job's start (the steps' times are Unix times)
    stage_s: dict[str, float] = field(
        default_factory=lambda: {
            "startup": 0.0,  # until the first replica is up (units are read meanwhile)
            "run": 0.0,  # from then until the last row is written
            "read": 0.0,
            "tokenize": 0.0,
            "generate": 0.0,
            "write": 0.0,
        }
    )
    wall_s: float = 0.0
    # Why the job stopped before the end: {"kind": "crash_loop" (a replica failed
    # replicas.max_consecutive_failures times in a row: "replica", "failures") or "failed",
    # "type", "message", "traceback"}; None when it ran to the end.
    error: dict | None = None

    @property
    def is_complete(self) -> bool:
        """Every input row has an output row (an error row counts)."""
        return not self.missing

    @property
    def rows_per_s(self) -> float:
        return self.rows_written / self.wall_s if self.wall_s else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    def to_dict(self) -> dict:
        return asdict(self) | {
            "rows_per_s": round(self.rows_per_s, 3),
            "output_tokens_per_s": round(self.output_tokens_per_s, 3),
        }

    def summary(self) -> str:
        lines = [
            f"job {self.job}: {self.rows_written} rows written "
            f"({self.rows_with_error} with errors), {self.rows_skipped_resumed} already done",
            f"tokens: {self.prompt_tokens} prompt, {self.output_tokens} output; "
            f"{self.rows_per_s:.2f} rows/s, {self.output_tokens_per_s:.1f} output tokens/s "
            f"over {self.wall_s:.1f} s",
            "time per stage (s): " + ", ".join(f"{k} {v:.1f}" for k, v in self.stage_s.items()),
        ]
        for i, p in enumerate(self.pipeline):
            busy = " ".join(f"{b:.0%}" for b in p["busy"])
            lines.append(f"replica {i} pipeline: stage busy {busy}; bubble {p['bubble']:.0%}")
        for i, d in enumerate(self.decode_groups):
            lines.append(f"replica {i} handoff: {handoff_line(d)}")
        for i, c in enumerate(self.cache):
            lines.append(f"replica {i} cache: {cache_line(c)}")
        for i, z in enumerate(self.sizing):
            lines.append(f"replica {i} sizing: {sizing_line(z)}")
        for i, a in enumerate(self.engine_steps):
            lines.append(f"replica {i} engine: {account_line(a)}")
        if self.replica_failures:
            lines.append(
                f"replica failures: {self.replica_failures}, rows retried: {self.rows_retried}"
            )
        if self.error is not None:
            e = self.error
            head = (f"replica {e['replica']} failed {e['failures']} times in a row (a crash loop)"
                    if e["kind"] == "crash_loop" else "the job failed")  # fmt: skip
            lines.append(f"STOPPED: {head}: {e['type']}: {e['message']}")
            lines += [f"  {line}" for line in e["traceback"].splitlines()]
        if self.unreadable_inputs:
            lines.append("UNREADABLE input (rows not processed; fix and rerun to resume):")
            lines += [f"  {e}" for e in self.unreadable_inputs]
        if self.missing:
            lines.append("INCOMPLETE: input rows with no output row:")
            for m in self.missing:
                rows = "an unknown number of rows" if m["rows"] is None else f"{m['rows']} rows"
                lines.append(f"  {m['file']}: {rows}; batches {m['batches']}: {m['why'][0]}")
        return "\n".join(lines)


def handoff_line(group: dict) -> str:
    """Handoffs of one decode group (`DecodeGroupRunner.stats`), per request: the bytes all
    ranks received, the time (the slowest rank's mean, from posting its receives to the data
    in its memory; the ranks receive at once) and the bandwidth that gives."""
    n = max(group["handoffs"], 1)
    per_req = sum(group["handoff_bytes_per_rank"]) / n
    seconds = max(group["handoff_s_per_rank"]) / n
    gbps = per_req / seconds / 1e9 if seconds else 0.0
    return (
        f"{group['handoffs']} requests, {per_req:,.0f} B, {seconds * 1e3:.2f} ms, "
        f"{gbps:.2f} GB/s each (bytes per rank {group['handoff_bytes_per_rank']})"
    )


def cache_line(stats: dict) -> str:
    """Prefix-cache hit rate, prefill tokens saved and retractions of one replica's accounts
    (`Engine.cache_stats`)."""
    pre = stats.get("prefill") or stats["cache"]
    admitted, prompt = max(pre["admitted"], 1), max(pre["prompt_tokens"], 1)
    retracted = sum(s["retracted"] for s in stats.values())
    return (
        f"prefix hits {pre['prefix_hits']}/{pre['admitted']} requests "
        f"({pre['prefix_hits'] / admitted:.0%}), prefill tokens saved "
        f"{pre['prefix_hit_tokens']}/{pre['prompt_tokens']} "
        f"({pre['prefix_hit_tokens'] / prompt:.0%}); {retracted} retracted"
    )


def sizing_line(z: dict) -> str:
    """`Engine.sizing` in a line: limits, arena per device, prefill workspace."""
    gib = 2**30
    arena = " + ".join(f"{b / gib:.1f}" for b in z["arena_bytes"])
    ws = z["workspace_bytes"]
    return (
        f"max_num_seqs {z['max_num_seqs']}, max_batch_tokens {z['max_batch_tokens']}, "
        f"arena {arena} GiB, prefill workspace "
        + ("not measured" if ws is None else f"{ws / gib:.2f} GiB")
    )


class Progress:
    def __init__(self, total_rows: int | None, done_rows: int, stream=None):
        self.total, self.start_done = total_rows, done_rows
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.monotonic()
        self.last = 0.0

    def update(self, done_rows: int, output_tokens: int, *, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last < (0.5 if self.tty else 10.0):
            return
        self.last = now
        el = max(now - self.t0, 1e-9)
        rate = (done_rows - self.start_done) / el
        if self.total:
            left = self.total - done_rows
            eta = f"{left / rate:.0f}s" if rate > 0 else "?"
            head = f"{done_rows}/{self.total} rows ({100 * done_rows / self.total:.0f}%)"
        else:
            head, eta = f"{done_rows} rows", "?"
        line = f"{head} | {rate:.2f} rows/s | {output_tokens / el:.1f} tok/s | ETA {eta}"
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
