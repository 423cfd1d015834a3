"""`python -m k3batch.sim.validate`: the simulation against every measurement we have (issue 55's
validation table). Each row: the prediction from the calibration tables (`sim.calibration`),
the cluster catalog (`sim.cluster`) and the code (the engine's own scheduler on virtual-clock
runners, `sim.clock` / `sim.cost`; the volumes of `sim.comm`), beside the recorded value, their
ratio, the issue's tolerance and PASS / MISS. Nothing is fitted to these rows: a MISS says which
term of the model is off, from the recording's own facts (how it ran, what it measured beside).

Rows, each read from its file in benchmarks/ (measured values are only ever read there):
- engine (one H200, 10%): `bench engine` rows of k3-slice (`engine_k3slice_h200.jsonl`: the
  latest row of each batch, prompt_len, new_tokens, chunk_size and expert dtype; rows of a MoE
  GEMM other than the default left out), prefill tok/s and decode step ms, by bench engine's
  own procedure (`bench.engine.engine_throughput`) on a simulated engine (`sim.replay`).
- job (one H200, 10%): the latest `bench job` of k3-slice, 1,024 prompts of 1,024 -> 256
  (`job_h200.jsonl`), output tok/s after start-up (and the engine alone on the same prompts):
  the engine sized as the job sized it, run to its end by `sim.clock.drive`.
- layouts (two H200s of one node, 15%): `layouts_k3slice_h200x2.jsonl`, by `bench layouts`'
  procedures: PP2 prefill of one prompt in chunks through a `SimPipeline`, TP2 prefill as one
  rank's forwards one after another, TP2 and TP2/DCP2 decode steps.
- pd (two H200s, bytes exact, time 15%): the k3-slice handoff of `pd_h200x2.txt` (prose, parsed).
- fill (this machine's CPU; 10% of the fill, a tolerance chosen here, the issue names none):
  `pipeline_fill_cpu.json`, the fill of an 8-stage chunked prefill pipeline of k3-debug against
  chunk counts, predicted from a CPU calibration of k3-debug (measured by this command unless
  given) and a SimPipeline, beside the teaching n / (n + P - 1).
What no row models: host time (the engine's bookkeeping, sampling, launches: `HostCost` is zero
here), so a recording whose steps are host-bound reads slower than predicted.
Records: `--only 1,2 --out benchmarks/sim_validation_h200.txt` with the H200 tables (the
GPU rows; pd needs no table); `--only 3 --out benchmarks/sim_validation_cpu.txt` on the CPU
machine the fill was recorded on (the 2-core dev machine).
"""

import os
import sys
from pathlib import Path

import click

from k3batch.model import get_flavor
from k3batch.sim.calibration import Calibration
from k3batch.sim.checks import (
    FILL_FLAVOR,
    GROUPS,
    TABLES,
    TOLERANCE,
    Check,
    engine_checks,
    fill_checks,
    job_checks,
    layout_checks,
    pd_checks,
)
from k3batch.sim.cluster import GPUS, cluster_from
from k3batch.sim.records import BENCH
from k3batch.sim.replay import cpu_calibration


# ---- the table --------------------------------------------------------------------------------
def run_checks(groups=GROUPS, *, calibration=None, cpu_table=None, flavor: str = "k3-slice",
               records_dir: Path = BENCH) -> list[Check]:  # fmt: skip
    """The checks of `groups` (of GROUPS): engine and job on one H200 (`cluster_from("h200x1")`),
    layouts and pd on one node of two (`"h200x2"`), with `calibration` (the GPU table, as
    measured: its GPU is the cluster's) for `flavor`; fill with `cpu_table` (a CPU table of
    FILL_FLAVOR)."""
    config, out = get_flavor(flavor), []
    one, two = cluster_from("h200x1"), cluster_from("h200x2")
    if "engine" in groups:
        out += engine_checks(config, calibration, one, records_dir)
    if "job" in groups:
        out += job_checks(config, calibration, one, records_dir)
    if "layouts" in groups:
        out += layout_checks(config, calibration, two, records_dir)
    if "pd" in groups:
        out += pd_checks(config, two, records_dir, flavor)
    if "fill" in groups:
        out += fill_checks(cpu_table, records_dir)
    return out


def table_lines(label: str, cal: Calibration) -> list[str]:
    """A calibration table's header: GPU, clocks, commit, command."""
    h = cal.header
    clocks = (f"SM {h['sm_mhz']}/{h['max_sm_mhz']} MHz, power limit {h['power_limit_w']:g} W"
              if "sm_mhz" in h else "no clocks (not a GPU)")  # fmt: skip
    first = (f"calibration {label}: {h.get('gpu')}, flavor {h.get('flavor')}, "
             f"{h.get('dtype')}, {clocks}, commit {h.get('commit')}, {h.get('time')}, "
             f"{len(cal.points)} points")  # fmt: skip
    return [first, f"  command: {h.get('command')}"]


def _num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, int) or abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3f}"


GROUP_TITLES = {
    "engine": "1. one H200: bench engine, k3-slice",
    "job": "1. one H200: bench job, k3-slice",
    "layouts": "2. two H200s (one node): bench layouts, k3-slice",
    "pd": "2. two H200s (one node): the 1+1 handoff, k3-slice",
    "fill": "3. CPU: the fill of a chunked prefill pipeline, k3-debug, stage actors on 2 cores",
}
VERDICTS = ("PASS", "MISS", "N/A")  # judged; "-": shown, not judged


def format_checks(checks: list[Check]) -> list[str]:
    """The rows by group, each group's MISS and N/A lines after it, and a tally."""
    lines, tally = [], dict.fromkeys(VERDICTS, 0)
    for group in GROUPS:
        rows = [c for c in checks if c.group == group]
        if not rows:
            continue
        exact = ", bytes exact" if group == "pd" else ""
        title = f"## {GROUP_TITLES[group]} ({rows[0].source}; tolerance {TOLERANCE[group]:.0%}"
        columns = (f"{'id':<4} {'measurement':<62} {'predicted':>12} {'measured':>12} "
                   f"{'pred/meas':>9} {'verdict':>7}")  # fmt: skip
        lines += ["", f"{title}{exact})", columns]
        notes = []
        for i, c in enumerate(rows, 1):
            cid = f"{group[0].upper()}{i}"
            ratio = "-" if c.ratio is None else f"{c.ratio:.3f}"
            line = (f"{cid:<4} {c.what:<62} {_num(c.predicted):>12} {_num(c.measured):>12} "
                    f"{ratio:>9} {c.verdict:>7}")  # fmt: skip
            lines.append(f"{line}  {c.extra}" if c.extra else line)
            if c.verdict in tally:
                tally[c.verdict] += 1
            if c.verdict in ("MISS", "N/A"):
                notes.append(f"  {c.verdict} {cid}: {c.why}")
        lines += notes
    counts = ", ".join(f"{v} {n}" for v, n in tally.items())
    return [*lines, "", f"tally: {counts} of {sum(tally.values())} judged rows"]


def _groups(only: str | None) -> tuple[str, ...]:
    if not only:
        return GROUPS
    numbered = {"1": ("engine", "job"), "2": ("layouts", "pd"), "3": ("fill",)}
    out = []
    for word in only.split(","):
        word = word.strip()
        if word not in GROUPS and word not in numbered:
            raise click.BadParameter(f"{word!r}: rows are {', '.join(GROUPS)} or 1, 2, 3")
        out += numbered.get(word, (word,))
    return tuple(g for g in GROUPS if g in out)


def _shown(path: str) -> str:
    """A path as the table shows it: from the repository's root when inside it."""
    p = Path(path).resolve()
    return str(p.relative_to(BENCH.parent)) if p.is_relative_to(BENCH.parent) else path


def header_lines(groups, tables: list[tuple[str, Calibration]],
                 cpu: tuple[str, Calibration] | None) -> list[str]:  # fmt: skip
    """The command, the calibration tables' headers, the clusters, what is not modelled."""
    command = f"python -m k3batch.sim.validate {' '.join(sys.argv[1:])}".rstrip()
    lines = [("# sim validation: predicted (calibration tables + communication model + the "
              "engine's own scheduler on a virtual clock) vs measured; nothing fitted to these "
              "rows"), f"# command: {command}"]  # fmt: skip
    for label, cal in [*tables, *([cpu] if cpu else [])]:
        lines += table_lines(label, cal)
    for name, preset, need in (("engine, job", "h200x1", {"engine", "job"}),
                               ("layouts, pd", "h200x2", {"layouts", "pd"})):  # fmt: skip
        if need & set(groups):
            first, *rest = cluster_from(preset).lines()
            lines += [f"cluster ({name} rows): {first}", *rest]
    lines.append("not modelled: host time (HostCost 0: the engine's bookkeeping, sampling and "
                 "eager launches), the driver's intake and writes")  # fmt: skip
    return lines


@click.command()
@click.option("--calibration", "tables", default=None,
              show_default=",".join(f"benchmarks/{t}" for t in TABLES),
              help="GPU calibration tables (JSONL), comma-separated, merged in order "
              "(`Calibration.merge`: a later table's points of a part replace an earlier "
              "one's).")  # fmt: skip
@click.option("--cpu-calibration", "cpu_path",
              type=click.Path(exists=True, dir_okay=False),
              help="CPU table of k3-debug for the fill rows (default: measured now).")  # fmt: skip
@click.option("--only", help="Rows: of engine, job, layouts, pd, fill; or 1 (engine, job), "
              "2 (layouts, pd), 3 (fill).")  # fmt: skip
@click.option("--out", "out_path", type=click.Path(dir_okay=False), help="Also write it here.")
def main(tables, cpu_path, only, out_path):
    """The validation table: predicted (calibration + communication model + the engine on a
    virtual clock) against every recorded measurement."""
    groups = _groups(only)
    loaded, cpu = [], None
    if {"engine", "job", "layouts"} & set(groups):
        for path in (tables or ",".join(str(BENCH / t) for t in TABLES)).split(","):
            if not Path(path).is_file():
                raise click.UsageError(f"calibration table {path} does not exist: run "
                                       "`k3batch bench calibrate` on an H200 (or --only "
                                       "pd,fill)")  # fmt: skip
            loaded.append((_shown(path), Calibration.load(path)))
    if "fill" in groups:
        cpu = ((_shown(cpu_path), Calibration.load(cpu_path)) if cpu_path
               else (f"measured by this command ({os.cpu_count()} cores here)",
                     cpu_calibration(FILL_FLAVOR)))  # fmt: skip
    cal = Calibration.merge(c for _, c in loaded) if loaded else None
    lines = header_lines(groups, loaded, cpu)
    if cal is not None and "H200" not in cal.gpu:
        measured = cal.gpu
        cal = cal.on(GPUS["h200"])
        lines.append(f"note: the tables were measured on {measured}, the records on H200s: the "
                     f"points are carried to the H200 ({cal.source})")  # fmt: skip
    lines += format_checks(run_checks(groups, calibration=cal, cpu_table=cpu and cpu[1]))
    text = "\n".join(lines)
    click.echo(text)
    if out_path:
        Path(out_path).write_text(text + "\n")


if __name__ == "__main__":
    main()
