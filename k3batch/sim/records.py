"""The recorded measurements in benchmarks/, read for `sim.validate`: the rows of `bench
engine`, `bench job`, `bench layouts` and `bench pipeline` (JSON and JSONL as the commands wrote
them) and the handoffs of a prose record (`pd_h200x2.txt`, parsed from the lines
`driver.report.handoff_line` prints). Readers only: no figure is copied out of these files.
"""

import json
import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
MEASURED_GPUS = ("h200", "h100")  # whose recorded calibration tables are the default, in order


def recorded_tables() -> tuple[str, str]:
    """The default calibration tables (k3's, then k3-slice's), under BENCH: those of the first
    GPU of MEASURED_GPUS that has a k3 table (the H200's, else the H100's)."""
    gpu = next((g for g in MEASURED_GPUS if (BENCH / f"calibration_{g}.jsonl").exists()),
               MEASURED_GPUS[0])  # fmt: skip
    return f"calibration_{gpu}.jsonl", f"calibration_{gpu}_k3-slice.jsonl"


def read_jsonl(path) -> list[dict]:
    """The rows of a JSONL file (blank lines skipped)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def expert_dtype(row: dict) -> str:
    """A bench row's routed experts: rows from before MXFP4 experts name none (bf16)."""
    dtype = row.get("expert_dtype") or "bf16"
    return "bf16" if dtype == "bfloat16" else dtype


def engine_rows(path=BENCH / "engine_k3slice_h200.jsonl", flavor: str = "k3-slice") -> list[dict]:
    """The latest row (file order) of each (batch, prompt_len, new_tokens, chunk_size, expert
    dtype) of `bench engine` on `flavor`, leaving out rows of a non-default MoE GEMM (a
    --moe-gemm variant, not the engine's own path)."""
    latest = {}  # key -> row, in the order of each key's latest row
    for row in read_jsonl(path):
        if row.get("flavor") != flavor or row.get("moe_gemm", "auto") != "auto":
            continue
        key = (row["batch"], row["prompt_len"], row["new_tokens"], row["chunk_size"],
               expert_dtype(row))  # fmt: skip
        latest.pop(key, None)
        latest[key] = row
    return list(latest.values())


def job_row(path=BENCH / "job_h200.jsonl", flavor: str = "k3-slice", num_prompts: int = 1024,
            input_len: int = 1024, output_len: int = 256) -> dict:  # fmt: skip
    """The latest `bench job` row of that workload."""
    want = (flavor, num_prompts, input_len, output_len)
    rows = [r for r in read_jsonl(path) if (r["flavor"], r["num_prompts"], r["input_len"],
                                            r["output_len"]) == want]  # fmt: skip
    if not rows:
        raise ValueError(f"{path}: no bench job row of {flavor}, {num_prompts} x {input_len} -> "
                         f"{output_len}")  # fmt: skip
    return rows[-1]


def pd_handoffs(path=BENCH / "pd_h200x2.txt") -> list[dict]:
    """The `bench job` handoffs of a prose record: for each "## k3batch bench job" command, its
    flavor and input length with the "handoff: N requests, B B, T ms, G GB/s each" line after
    it (bytes and ms per request, as `driver.report.handoff_line` prints them)."""
    out, cmd = [], None
    line_re = re.compile(r"handoff: (\d+) requests, ([\d,]+) B, ([\d.]+) ms, ([\d.]+) GB/s each")
    for line in Path(path).read_text().splitlines():
        if line.startswith("##"):
            if "k3batch bench job" in line:
                cmd = {"flavor": re.search(r"--flavor (\S+)", line).group(1),
                       "command": line.lstrip("# ").strip()}  # fmt: skip
            elif cmd and line.startswith("##   "):  # the command's continuation
                cmd["command"] += " " + line.lstrip("# ").strip()
            else:
                cmd = None
        elif cmd and (m := line_re.search(line)):
            n_in = int(re.search(r"--input-len (\d+)", cmd["command"]).group(1))
            out.append(cmd | {"input_len": n_in, "requests": int(m.group(1)),
                              "bytes": int(m.group(2).replace(",", "")),
                              "ms": float(m.group(3)), "gb_per_s": float(m.group(4))})  # fmt: skip
    return out


def fill_record(path=BENCH / "pipeline_fill_cpu.json") -> dict:
    """`bench pipeline --json`'s record: stages, chunk_tokens, device, rows (chunks, fill,
    busy per stage, wall_s, teaching_fill)."""
    return json.loads(Path(path).read_text())


def host_row(path=BENCH / "host_cpu.jsonl") -> dict | None:
    """The first `bench host` row with per-step figures (host ms per prefill and decode step)."""
    rows = [r for r in read_jsonl(path) if isinstance(r.get("prefill_host_ms_per_step"), float)]
    return rows[0] if rows else None
