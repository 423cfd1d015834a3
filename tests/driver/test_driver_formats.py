"""Issue 52 through `run_job` (fake replica, shared Ray head): per input format, a folder of good
rows, bad lines and one unreadable file writes every good row once, flags each bad line with its
number, and a rerun after a kill (shards lost) completes exactly once; per output format, the
shards and the merged file; OpenAI output lines parsed back by the `openai` package's types."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from k3batch.driver import run_job
from k3batch.driver.fake import FakeReplica
from k3batch.engine.request import SamplingParams
from k3batch.driver.jobspec import EngineConfig, InputSpec, JobSpec, OutputSpec, ReplicaSpec
from k3batch.io import ShardSink

GOOD = [f"good prompt {i}" for i in range(5)]


def _spec(model_dir, inp, out, *, fmt="auto", out_fmt="parquet", merge=False) -> JobSpec:
    return JobSpec(
        model=model_dir,
        name="formats",
        input=InputSpec(path=str(inp), batch_rows=2, format=fmt),
        output=OutputSpec(path=str(out), format=out_fmt, merge=merge),
        sampling=SamplingParams(temperature=0, max_new_tokens=2),
        replicas=ReplicaSpec(device="cpu", max_inflight_rows=4, wait_timeout_s=120.0),
        engine=EngineConfig(max_seq_len=128),
    )


def _run(spec, replica_cls=FakeReplica):
    return run_job(spec, replica_cls=replica_cls)


def _write_jsonl(d, openai=False):
    def row(i, p):
        if openai:
            body = {"model": "k3-mini", "messages": [{"role": "user", "content": p}]}
            return json.dumps({"custom_id": f"g{i}", "method": "POST",
                               "url": "/v1/chat/completions", "body": body})  # fmt: skip
        return json.dumps({"id": f"g{i}", "prompt": p})

    lines = [row(0, GOOD[0]), "{bad json", row(1, GOOD[1]), row(2, GOOD[2])]
    (d / "a.jsonl").write_text("\n".join(lines) + "\n")
    (d / "b.jsonl").write_text("\n".join([row(3, GOOD[3]), "[]", row(4, GOOD[4])]) + "\n")
    (d / "c.jsonl.gz").write_bytes(b"not gzip at all")  # unreadable
    return {"a.jsonl": [2], "b.jsonl": [2]}  # bad lines per file


def _write_csv(d):
    (d / "a.csv").write_text(f"id,prompt\ng0,{GOOD[0]}\nx,y,z\ng1,{GOOD[1]}\ng2,\"{GOOD[2]}\"\n")
    (d / "b.csv").write_text(f"id,prompt\ng3,{GOOD[3]}\ng4,{GOOD[4]}\n")
    (d / "c.csv").write_bytes(b"id,prompt\n\xff\xfe,x\n")  # not UTF-8
    return {"a.csv": [3]}


def _write_arrow(d):
    t = pa.table({"id": [f"g{i}" for i in range(5)], "prompt": GOOD})
    with pa.OSFile(str(d / "a.arrow"), "wb") as sink, pa.ipc.new_file(sink, t.schema) as w:
        w.write_table(t, max_chunksize=2)
    (d / "b.arrow").write_bytes(b"ARROW1 garbage")
    return {}


@pytest.mark.parametrize("kind", ["jsonl", "csv", "arrow", "openai"])
def test_input_format_mixed_folder_every_good_row_once_and_resume(
    cluster, mini_model_dir, tmp_path, kind
):
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    writer = {"jsonl": _write_jsonl, "csv": _write_csv, "arrow": _write_arrow,
              "openai": lambda d: _write_jsonl(d, openai=True)}[kind]  # fmt: skip
    bad_lines = writer(inp)
    spec = _spec(mini_model_dir, inp, out, fmt="openai" if kind == "openai" else "auto")
    report = _run(spec)
    assert len(report.unreadable_inputs) == 1, report.unreadable_inputs
    rows = pq.read_table(out).to_pylist()
    good = [r for r in rows if r["error"] is None]
    assert sorted(r["id"] for r in good) == [f"g{i}" for i in range(5)]  # each once
    errors = sorted(r["error"] for r in rows if r["error"] is not None)
    expected = sorted(f"{name}:line{n}" for name, ns in bad_lines.items() for n in ns)
    assert sorted(
        e.split("/")[-1].split(": ")[0] + ":" + e.split(": ")[1].replace(" ", "") for e in errors
    ) == expected, errors

    # A driver killed before its last shards committed: they are missing; the rerun writes
    # exactly those rows, and every row is there once.
    sink = ShardSink(str(out))
    lost = sorted(sink.committed())[1::2]
    for f, b in lost:
        (out / f"part-f{f:05d}-b{b:06d}.parquet").unlink()
    again = _run(spec)
    assert again.rows_skipped_resumed + again.rows_written == len(rows)
    assert pq.read_table(out).to_pylist() == rows  # the same rows, in the same shards


def test_hf_folder_input(cluster, mini_model_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"id": [f"g{i}" for i in range(5)], "prompt": GOOD}).save_to_disk(
        str(tmp_path / "ds"), num_shards=2
    )
    _run(_spec(mini_model_dir, tmp_path / "ds", tmp_path / "out"))
    rows = pq.read_table(tmp_path / "out").to_pylist()
    assert sorted(r["id"] for r in rows) == [f"g{i}" for i in range(5)]
    assert all(r["error"] is None for r in rows)


@pytest.mark.parametrize("out_fmt", ["parquet", "jsonl", "openai"])
def test_output_format_shards_and_merge_once_complete(
    cluster, mini_model_dir, tmp_path, out_fmt
):
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    _write_jsonl(inp, openai=out_fmt == "openai")
    (inp / "c.jsonl.gz").unlink()  # a complete job: every file readable
    spec = _spec(mini_model_dir, inp, out, fmt="openai" if out_fmt == "openai" else "auto",
                 out_fmt=out_fmt, merge=True)  # fmt: skip
    report = _run(spec)
    assert report.missing == []
    ext = "parquet" if out_fmt == "parquet" else "jsonl"
    shards = sorted(p.name for p in out.glob(f"part-*.{ext}"))
    assert len(shards) == 4  # a: 2 units of 2 rows, b: 2 units
    merged = out / f"_merged.{ext}"

    def merged_rows():
        if ext == "parquet":
            return pq.read_table(merged).to_pylist()
        return [json.loads(x) for x in merged.read_text().splitlines()]

    first = merged_rows()
    assert len(first) == 7  # 5 good rows and 2 bad lines, in unit order
    key = "custom_id" if out_fmt == "openai" else "id"
    assert [r[key] for r in first] == ["g0", None, "g1", "g2", "g3", None, "g4"]
    # Killed after the last shard, before the merge: the rerun merges, from all shards.
    merged.unlink()
    _run(spec)
    assert [r[key] for r in merged_rows()] == [r[key] for r in first]
    # Killed with a shard lost: the rerun commits it and merges again.
    (out / shards[0]).unlink()
    _run(spec)
    assert [r[key] for r in merged_rows()] == [r[key] for r in first]


def test_openai_round_trip_every_row_kind_parses_as_openai_types(
    cluster, mini_model_dir, tmp_path
):
    types = pytest.importorskip("openai.types")
    from openai.types.chat import ChatCompletion

    def req(cid, url="/v1/chat/completions", **body):
        if url.endswith("chat/completions") and "messages" not in body:
            body["messages"] = [{"role": "user", "content": f"hello {cid}"}]
        return {"custom_id": cid, "method": "POST", "url": url, "body": body}

    lines = [
        req("chat"),
        req("chat-logprobs", logprobs=True, max_completion_tokens=3, seed=1),
        req("text", url="/v1/completions", prompt="once upon", max_tokens=2, stop=["\n"]),
        req("ids", url="/v1/completions", prompt=[5, 6, 7], logprobs=0),
        req("n2", n=2),
        req("get", url="/v1/embeddings"),
        req("other-model", model="gpt-4o"),  # a warning only (no strict_model)
    ]
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join(json.dumps(x) for x in lines) + "\n{oops\n")
    spec = _spec(mini_model_dir, inp, tmp_path / "out", fmt="openai", out_fmt="openai",
                 merge=True)  # fmt: skip
    _run(spec)
    got = [json.loads(x) for x in (tmp_path / "out" / "_merged.jsonl").read_text().splitlines()]
    assert [g["custom_id"] for g in got] == [x["custom_id"] for x in lines] + [None]
    by_id = {g["custom_id"]: g for g in got}
    for g in got:
        assert g["id"].startswith("batch_req_")
        if g["error"] is not None:
            assert g["response"] is None
            types.BatchError.model_validate(g["error"])
            continue
        body = g["response"]["body"]
        assert g["response"]["status_code"] == 200 and g["response"]["request_id"]
        model = ChatCompletion if body["object"] == "chat.completion" else types.Completion
        parsed = model.model_validate(body)
        usage = parsed.usage
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert by_id["n2"]["error"]["message"].endswith("body.n = 2: only n = 1 is supported")
    assert "url = '/v1/embeddings'" in by_id["get"]["error"]["message"]
    assert "line 8: malformed JSON" in got[-1]["error"]["message"]
    chat_lp = ChatCompletion.model_validate(by_id["chat-logprobs"]["response"]["body"])
    assert len(chat_lp.choices[0].logprobs.content) == chat_lp.usage.completion_tokens == 3
    assert by_id["chat"]["response"]["body"]["choices"][0]["logprobs"] is None
    text = types.Completion.model_validate(by_id["ids"]["response"]["body"])
    assert len(text.choices[0].logprobs.token_logprobs) == text.usage.completion_tokens
    assert text.usage.prompt_tokens == 3
    assert by_id["other-model"]["response"]["body"]["model"] == "gpt-4o"


def test_same_prompts_in_every_format_give_identical_tokens(
    cluster, mini_model_dir, tmp_path
):
    """The real replica (k3-mini, greedy): Parquet, JSONL, CSV and OpenAI completions input of
    the same prompts give the same output tokens per id."""
    prompts = {"a": "hello there", "b": "the quick brown fox", "c": "1, 2, 3,"}
    d = {k: tmp_path / k for k in ("parquet", "jsonl", "csv", "openai")}
    for p in d.values():
        p.mkdir()
    pq.write_table(pa.table({"id": list(prompts), "prompt": list(prompts.values())}),
                   d["parquet"] / "x.parquet")  # fmt: skip
    (d["jsonl"] / "x.jsonl").write_text(
        "".join(json.dumps({"id": k, "prompt": v}) + "\n" for k, v in prompts.items()))
    (d["csv"] / "x.csv").write_text(
        "id,prompt\n" + "".join(f'{k},"{v}"\n' for k, v in prompts.items()))
    (d["openai"] / "x.jsonl").write_text("".join(
        json.dumps({"custom_id": k, "method": "POST", "url": "/v1/completions",
                    "body": {"model": "k3-mini", "prompt": v, "max_tokens": 4}}) + "\n"
        for k, v in prompts.items()))  # fmt: skip
    tokens = {}
    for kind, inp in d.items():
        spec = _spec(mini_model_dir, inp, tmp_path / f"out-{kind}",
                     fmt="openai" if kind == "openai" else "auto")  # fmt: skip
        spec = spec.__class__(**{**{f: getattr(spec, f) for f in spec.__dataclass_fields__},
                                 "sampling": SamplingParams(temperature=0, max_new_tokens=4)})
        run_job(spec)
        rows = pq.read_table(tmp_path / f"out-{kind}").to_pylist()
        assert all(r["error"] is None for r in rows), rows
        tokens[kind] = {r["id"]: r["output_token_ids"] for r in rows}
    assert all(len(t) == 4 for t in tokens["parquet"].values())
    for kind in ("jsonl", "csv", "openai"):
        assert tokens[kind] == tokens["parquet"], kind
