"""k3batch.io input formats: JSON Lines (plain and gzip), CSV, Arrow IPC, a Hugging Face
save_to_disk folder and OpenAI batch requests read as deterministic units, with a malformed line
as that row's error (its line number) and the rows after it keeping their numbers. CPU only."""

import gzip
import json

import pyarrow as pa
import pytest
from pyarrow import feather

from k3batch.io.resolve import resolve_input
from k3batch.io.source import count_rows, iter_units


def _jsonl(path, lines: list) -> str:
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    if str(path).endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return str(path)


def _read(spec: str, batch_rows: int, **kw):
    fs, files = resolve_input(spec, **kw)
    return files, list(iter_units(fs, files, batch_rows))


@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.gz", "a.json"])
def test_jsonl_bad_lines_are_row_errors_numbers_kept(tmp_path, name):
    path = _jsonl(tmp_path / name, [
        {"id": "r0", "prompt": "p0", "temperature": 0.5},
        "{not json",
        "",  # a blank line is no row
        {"id": "r2", "prompt": 7},
        [1, 2],
        {"id": 4, "prompt": "p4", "extra": {"k": 1}},
    ])  # fmt: skip
    files, units = _read(path, 2)
    assert files[0].format == "jsonl"
    fs, _ = resolve_input(path)
    assert count_rows(fs, files) == [5]
    shape = [(u.batch_idx, u.row_offset, u.table.num_rows) for u in units]
    assert shape == [(0, 0, 2), (1, 2, 2), (2, 4, 1)]
    assert units[0].table.column("id").to_pylist() == ["r0", None]
    assert units[0].row_errors[1].startswith("line 2: malformed JSON")
    assert units[1].row_errors == {0: "line 4: prompt must be a string, got int",
                                   1: "line 5: expected a JSON object, got list"}  # fmt: skip
    assert units[2].row_errors is None
    assert units[2].table.column("id").to_pylist() == ["4"]  # an integer id as its text
    assert units[2].table.schema.names == ["id", "prompt", "temperature", "extra"]  # the file's


def test_jsonl_resume_skips_committed_units(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [{"prompt": f"p{i}"} for i in range(5)])
    fs, files = resolve_input(path)
    units = list(iter_units(fs, files, 2, skip=lambda f, b: b == 1))
    assert [u.batch_idx for u in units] == [0, 2]
    assert units[1].table.column("prompt").to_pylist() == ["p4"]


def test_csv_quoted_newlines_and_bad_records(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text(
        'id,prompt,max_new_tokens\n'
        'a,"two\nlines",3\n'
        'b,too,many,fields\n'
        'c,plain,\n'
        'd,x,lots\n'
    )
    files, units = _read(str(path), 10)
    (u,) = units
    assert files[0].format == "csv"
    assert u.table.column("prompt").to_pylist() == ["two\nlines", None, "plain", "x"]
    assert u.table.column("max_new_tokens").to_pylist() == [3, None, None, None]
    assert u.row_errors == {1: "line 4: expected 3 fields, got 4",
                            3: "line 6: max_new_tokens = 'lots' must be a number"}  # fmt: skip


def test_arrow_file_and_stream_rechunked(tmp_path):
    table = pa.table({"id": [f"r{i}" for i in range(7)], "prompt": [f"p{i}" for i in range(7)]})
    feather.write_feather(table, tmp_path / "a.feather", chunksize=3)
    with pa.OSFile(str(tmp_path / "b.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as w:
            for rb in table.to_batches(max_chunksize=2):
                w.write_batch(rb)
    for name in ("a.feather", "b.arrow"):
        files, units = _read(str(tmp_path / name), 4)
        assert files[0].format == "arrow"
        assert [u.table.num_rows for u in units] == [4, 3]
        assert pa.concat_tables([u.table for u in units]).equals(table)


def test_hf_save_to_disk_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"prompt": [f"p{i}" for i in range(10)]})
    ds.save_to_disk(str(tmp_path / "ds"), num_shards=2)
    files, units = _read(str(tmp_path / "ds"), 4)
    assert [f.format for f in files] == ["arrow", "arrow"]
    assert [p for u in units for p in u.table.column("prompt").to_pylist()] == ds["prompt"]


def test_mixed_formats_and_unknown_names_are_refused(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [{"prompt": "x"}])
    (tmp_path / "b.csv").write_text("prompt\nx\n")
    with pytest.raises(ValueError, match=r"mixes formats \(1 csv, 1 jsonl files\)"):
        resolve_input(str(tmp_path))
    _, files = resolve_input(str(tmp_path), format="csv")
    assert [f.format for f in files] == ["csv"]
    (tmp_path / "c.txt").write_text("x")
    with pytest.raises(ValueError, match="set input.format"):
        resolve_input(str(tmp_path / "c.txt"))
    with pytest.raises(ValueError, match="input.format = 'xml'"):
        resolve_input(str(tmp_path), format="xml")


def _req(cid, url="/v1/chat/completions", **body):
    if "messages" not in body and "prompt" not in body:
        body["messages"] = [{"role": "user", "content": f"hi {cid}"}]
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def test_openai_requests_become_rows_or_row_errors(tmp_path):
    path = _jsonl(tmp_path / "batch.jsonl", [
        _req("chat", model="m", max_tokens=5, max_completion_tokens=6, temperature=0, seed=3,
             stop="x", logprobs=True),
        _req("text", url="/v1/completions", prompt="once", max_tokens=4),
        _req("ids", url="/v1/completions", prompt=[1, 2, 3], logprobs=0),
        _req("n2", n=2),
        _req("top", logprobs=True, top_logprobs=3),
        _req("embed", url="/v1/embeddings"),
        {**_req("get"), "method": "GET"},
        _req("tools", tools=[{"type": "function"}]),
        _req("temp", temperature="hot"),
        "{broken",
    ])  # fmt: skip
    _, (u,) = _read(path, 16, format="openai")
    rows = u.table.to_pylist()
    assert [r["id"] for r in rows] == ["chat", "text", "ids", "n2", "top", "embed", "get",
                                       "tools", "temp", None]  # fmt: skip
    assert rows[0] | {"messages": None} == {
        "id": "chat", "url": "/v1/chat/completions", "model": "m", "messages": None,
        "prompt": None, "prompt_token_ids": None, "max_new_tokens": 6, "temperature": 0.0,
        "top_p": None, "seed": 3, "stop": ["x"], "logprobs": True,
    }  # fmt: skip
    assert rows[1]["prompt"] == "once" and rows[1]["max_new_tokens"] == 4
    assert rows[2]["prompt_token_ids"] == [1, 2, 3] and rows[2]["logprobs"] is True
    assert u.row_errors == {
        3: "line 4: body.n = 2: only n = 1 is supported",
        4: "line 5: body.top_logprobs = 3: only the sampled token's log-probability is kept",
        5: "line 6: url = '/v1/embeddings': expected '/v1/chat/completions' or '/v1/completions'",
        6: "line 7: method = 'GET': only 'POST' is supported",
        7: "line 8: body.tools is not supported",
        8: "line 9: temperature = 'hot' must be a number",
        9: u.row_errors[9],
    }
    assert u.row_errors[9].startswith("line 10: malformed JSON")
