"""Poison rows: nothing a row holds may crash a replica or the job; the row gets an error.

Three levels: the engine given bad requests directly (and an exception in one request's own
work), `prepare_rows` on a table of bad values of every column type, and a whole job over a
folder of poison files on the shared local Ray head.

Fails before the fix: a float or NaN seed passed `SamplingParams.validate`, then
`torch.Generator.manual_seed(3.5)` raised inside `Engine.add_request`, the replica process
exited, and after its restarts the job died; a float top_k failed in `torch.topk` the same way.
(Drop the type checks at the top of `SamplingParams.validate` and these tests fail.)
"""

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from k3batch.driver import run_job
from k3batch.engine import engine as engine_mod
from k3batch.engine.config import EngineConfig
from k3batch.engine.engine import Engine
from k3batch.engine.request import SamplingParams
from k3batch.driver.jobspec import InputSpec, JobSpec, OutputSpec, ReplicaSpec
from k3batch.driver.prompts import prepare_rows, row_sampling

NAN, INF = math.nan, math.inf
GREEDY = SamplingParams(temperature=0, max_new_tokens=2)


# ---- the engine -------------------------------------------------------------------------------

BAD_REQUESTS = {
    # request id: (prompt token ids, sampling overrides, words of the error)
    "ids-none": (None, {}, "list"),
    "ids-str": ("1 2 3", {}, "list"),
    "ids-empty": ([], {}, "empty"),
    "ids-text": ([1, "2"], {}, "'2' is not an integer"),
    "ids-bool": ([True, 2], {}, "True is not an integer"),
    "ids-float": ([1.0, 2], {}, "1.0 is not an integer"),
    "ids-nested": ([[1, 2]], {}, "not an integer"),
    "ids-null": ([1, None], {}, "None is not an integer"),
    "ids-negative": ([-1, 2], {}, "-1 outside the vocabulary"),
    "ids-huge": ([2**70], {}, "outside the vocabulary"),
    "ids-vocab-size": ([1, 512], {}, "512 outside the vocabulary"),  # kimi-linear-debug's 512
    "ids-too-long": ([1] * 40, {}, "max_seq_len"),
    "seed-float": ([1, 2], {"seed": 3.0}, "seed = 3.0"),
    "seed-nan": ([1, 2], {"seed": NAN}, "seed = nan"),
    "seed-str": ([1, 2], {"seed": "7"}, "seed = '7'"),
    "seed-negative": ([1, 2], {"seed": -1}, "seed = -1"),
    "seed-huge": ([1, 2], {"seed": 2**64}, "seed"),
    "seed-list": ([1, 2], {"seed": [1]}, "seed = [1]"),
    "top-k-float": ([1, 2], {"top_k": 3.0}, "top_k = 3.0"),
    "top-k-bool": ([1, 2], {"top_k": True}, "top_k = True"),
    "temperature-nan": ([1, 2], {"temperature": NAN}, "temperature = nan"),
    "temperature-inf": ([1, 2], {"temperature": INF}, "temperature = inf"),
    "temperature-str": ([1, 2], {"temperature": "0.5"}, "temperature = '0.5'"),
    "temperature-negative": ([1, 2], {"temperature": -0.5}, "temperature = -0.5"),
    "top-p-nan": ([1, 2], {"top_p": NAN}, "top_p = nan"),
    "top-p-dict": ([1, 2], {"top_p": {"p": 1}}, "top_p"),
    "max-new-tokens-float": ([1, 2], {"max_new_tokens": 2.5}, "max_new_tokens = 2.5"),
    "max-new-tokens-zero": ([1, 2], {"max_new_tokens": 0}, "max_new_tokens = 0"),
    "stop-ids-str": ([1, 2], {"stop_token_ids": ("a",)}, "stop_token_ids"),
    "ignore-eos-int": ([1, 2], {"ignore_eos": 1}, "ignore_eos = 1"),
}


def _sampling(**kw) -> SamplingParams:
    """SamplingParams holding whatever values, as a request built elsewhere could."""
    sp = SamplingParams(temperature=0.7, top_k=5, seed=1, max_new_tokens=2)
    for name, value in kw.items():
        object.__setattr__(sp, name, value)
    return sp


def test_engine_fails_bad_requests_alone(model_factory, monkeypatch):
    model = model_factory("kimi-linear-debug")
    # One request at a time: the good requests' arithmetic is then that of a run alone.
    config = EngineConfig(max_num_seqs=1, max_seq_len=32, chunk_size=16, max_batch_tokens=32)
    good = {
        "good-greedy": ([5, 6, 7], GREEDY),
        "good-sampled": ([8, 9], _sampling(seed=11)),
        "good-numpy-ids": ([np.int64(5), 6, np.int32(511)], GREEDY),
    }
    expected = {rid: [r.output_token_ids for r in Engine(model, config).generate([ids], [sp])][0]
                for rid, (ids, sp) in good.items()}  # fmt: skip

    # One request whose own work raises after the forward: it fails, the rest go on.
    real_sample = engine_mod.sample
    boom = _sampling(seed=13)

    def sample(logits, params, *args, **kw):
        if any(p is boom for p in params):
            raise RuntimeError("sampler exploded")
        return real_sample(logits, params, *args, **kw)

    monkeypatch.setattr(engine_mod, "sample", sample)
    engine = Engine(model, config)
    for rid, (ids, overrides, _) in BAD_REQUESTS.items():
        engine.add_request(rid, ids, _sampling(**overrides))
    engine.add_request("sampler-raises", [3, 4], boom)
    for rid, (ids, sp) in good.items():
        engine.add_request(rid, ids, sp)
    results = {}
    while engine.has_unfinished():
        for res in engine.step():
            assert res.request_id not in results, f"{res.request_id} finished twice"
            results[res.request_id] = res
    assert sorted(results) == sorted([*BAD_REQUESTS, "sampler-raises", *good])
    for rid, (_, _, words) in BAD_REQUESTS.items():
        assert results[rid].finish_reason == "error", rid
        assert words in results[rid].error, (rid, results[rid].error)
    assert "sampler exploded" in results["sampler-raises"].error
    for rid in good:
        assert results[rid].error is None and results[rid].output_token_ids == expected[rid], rid
    assert not engine.pool.num_requests  # nothing leaked


# ---- rows to work -----------------------------------------------------------------------------

# Each row holds one bad value (the other sampling columns null); the expected error's words.
NUMBER_ROWS = [
    ("good", {}, None),
    ("top_k-3.0", {"top_k": 3.0}, None),  # coerced to 3
    ("seed-7.0", {"seed": 7.0}, None),
    ("max_new_tokens-2.0", {"max_new_tokens": 2.0}, None),
    ("top_k-huge", {"top_k": 1e30}, None),  # an integer; larger than the vocabulary: no cut
    ("temperature-huge", {"temperature": 1e300}, None),
    ("temperature-tiny", {"temperature": 1e-300}, None),
    ("seed-3.5", {"seed": 3.5}, "seed = 3.5"),
    ("seed-nan", {"seed": NAN}, "seed = nan"),
    ("seed-inf", {"seed": INF}, "seed = inf"),
    ("seed-negative", {"seed": -1.0}, "seed = -1"),
    ("seed-huge", {"seed": 1e30}, "seed = 1000000000000000019884624838656"),
    ("top_k-3.5", {"top_k": 3.5}, "top_k = 3.5"),
    ("top_k-nan", {"top_k": NAN}, "top_k = nan"),
    ("top_k-negative", {"top_k": -2.0}, "top_k = -2"),
    ("temperature-nan", {"temperature": NAN}, "temperature = nan"),
    ("temperature-inf", {"temperature": INF}, "temperature = inf"),
    ("temperature-negative", {"temperature": -1.0}, "temperature = -1.0"),
    ("top_p-nan", {"top_p": NAN}, "top_p = nan"),
    ("top_p-zero", {"top_p": 0.0}, "top_p = 0.0"),
    ("top_p-large", {"top_p": 2.0}, "top_p = 2.0"),
    ("top_p-ninf", {"top_p": -INF}, "top_p = -inf"),
    ("max_new_tokens-nan", {"max_new_tokens": NAN}, "max_new_tokens = nan"),
    ("max_new_tokens-zero", {"max_new_tokens": 0.0}, "max_new_tokens = 0"),
    ("max_new_tokens-2.5", {"max_new_tokens": 2.5}, "max_new_tokens = 2.5"),
]
STRING_ROWS = [  # sampling columns of strings
    ("str-temperature", {"temperature": "0.5"}, "temperature = '0.5' (str)"),
    ("str-top_p", {"top_p": "x"}, "top_p = 'x' (str)"),
    ("str-top_k", {"top_k": "3"}, "top_k = '3' (str)"),
    ("str-seed", {"seed": ""}, "seed = '' (str)"),
    ("str-max_new_tokens", {"max_new_tokens": "2"}, "max_new_tokens = '2' (str)"),
]
NESTED_ROWS = [  # sampling columns of lists, structs and booleans
    ("list-temperature", {"temperature": [0.5]}, "temperature = [0.5] (list)"),
    ("empty-list-temperature", {"temperature": []}, "temperature = [] (list)"),
    ("struct-top_p", {"top_p": {"p": 0.5}}, "top_p = {'p': 0.5} (dict)"),
    ("bool-top_k", {"top_k": True}, "top_k = True (bool)"),
    ("list-seed", {"seed": [1, 2]}, "seed = [1, 2] (list)"),
    ("bool-max_new_tokens", {"max_new_tokens": False}, "max_new_tokens = False (bool)"),
]
PROMPT_ROWS = [  # (prompt, error words)
    ("hello kimi", None),
    ("\x00 \u2028 emoji \U0001f600", None),
    (None, "null"),
    ("", "empty"),
    ("word " * 100, "context limit"),
    ("x" * 200_000, "context limit"),
]
ID_ROWS = [  # (id, error words); the job's driver checks ids
    (None, "null"),
    ("", None),
    ("dup", None),
    ("dup", "duplicate"),  # the first occurrence in input order runs
    ("i" * 5000, None),
    ("nul\x00 \U0001f600", None),
]
MESSAGE_ROWS = [
    ([{"role": "user", "content": "hi"}], None),
    (None, "null"),
    ([], "non-empty list"),
    ([{"role": "user", "content": None}], "content"),
    ([{"role": None, "content": "hi"}], "role"),
    ([{"role": "hacker", "content": "hi"}], "unsupported role"),
    ([{"role": "user", "content": "x " * 100}], "context limit"),
]
TOKEN_ROWS = [
    ([5, 6, 7], None),
    (None, "null"),
    ([], "empty"),
    ([1, None], "list of integers"),
    ([-1, 3], "-1"),
    ([2**40], str(2**40)),
    ([1] * 100, "context limit"),
]
TOKEN_ROWS_OF_OTHER_TYPES = [  # one column type each: floats, nested lists, text
    (pa.array([[1.0, 2.0]], pa.list_(pa.float64())), "list of integers"),
    (pa.array([[[1, 2]]], pa.list_(pa.list_(pa.int64()))), "list of integers"),
    (pa.array(["1 2 3"], pa.string()), "list of integers"),
]
SAMPLING_COLUMNS = ("temperature", "top_p", "top_k", "seed", "max_new_tokens")
MAX_SEQ_LEN = 48


def _sampling_table(rows, types) -> pa.Table:
    cols = {"id": [rid for rid, _, _ in rows], "prompt": ["hello"] * len(rows)}
    for c in SAMPLING_COLUMNS:
        cols[c] = pa.array([values.get(c) for _, values, _ in rows], types[c])
    return pa.table(cols)


def poison_files() -> dict[str, tuple[pa.Table, list[str | None]]]:
    """File name -> (table, expected error words of each row): every bad per-row value above."""
    floats = {c: pa.float64() for c in SAMPLING_COLUMNS}
    strings = {c: pa.string() for c in SAMPLING_COLUMNS}
    nested = {
        "temperature": pa.list_(pa.float64()),
        "top_p": pa.struct([("p", pa.float64())]),
        "top_k": pa.bool_(),
        "seed": pa.list_(pa.int64()),
        "max_new_tokens": pa.bool_(),
    }
    files = {}
    for name, rows, types in [
        ("numbers", NUMBER_ROWS, floats),
        ("strings", STRING_ROWS, strings),
        ("nested", NESTED_ROWS, nested),
    ]:
        files[name] = (_sampling_table(rows, types), [w for _, _, w in rows])
    for name, column, rows, typ in [
        ("text", "prompt", PROMPT_ROWS, pa.string()),
        ("messages", "messages", MESSAGE_ROWS, None),
        ("token_ids", "prompt_token_ids", TOKEN_ROWS, pa.list_(pa.int64())),
    ]:
        ids = [f"{name}-{i}" for i in range(len(rows))]
        table = pa.table({"id": ids, column: pa.array([v for v, _ in rows], typ)})
        files[name] = (table, [w for _, w in rows])
    for i, (array, words) in enumerate(TOKEN_ROWS_OF_OTHER_TYPES):
        table = pa.table({"id": [f"type{i}"], "prompt_token_ids": array})
        files[f"token_ids_type{i}"] = (table, [words])
    ids = pa.array([i for i, _ in ID_ROWS], pa.string())
    files["ids"] = (pa.table({"id": ids, "prompt": ["hello"] * len(ids)}), [None] * len(ids))
    return files


def test_prepare_rows_gives_each_poison_row_its_error(mini_model_dir):
    for name, (table, expected) in poison_files().items():
        works = prepare_rows(
            table.drop_columns(["id"]),
            spec=InputSpec(),
            model_dir=mini_model_dir,
            defaults=GREEDY,
            max_seq_len=MAX_SEQ_LEN,
            vocab_size=512,
        )
        assert [w.row_idx for w in works] == list(range(table.num_rows)), name
        for rid, w, words in zip(table.column("id").to_pylist(), works, expected):
            if words is None:
                assert w.error is None and w.sampling is not None, (name, rid, w.error)
                w.sampling.validate()
            else:
                assert w.error is not None and words in w.error, (name, rid, w.error)
    works = prepare_rows(
        _sampling_table(NUMBER_ROWS[:4], {c: pa.float64() for c in SAMPLING_COLUMNS}),
        spec=InputSpec(),
        model_dir=mini_model_dir,
        defaults=GREEDY,
        max_seq_len=MAX_SEQ_LEN,
        vocab_size=512,
    )
    assert works[1].sampling.top_k == 3 and type(works[1].sampling.top_k) is int  # 3.0 -> 3
    assert works[2].sampling.seed == 7 and type(works[2].sampling.seed) is int


# ---- a whole job ------------------------------------------------------------------------------


def test_poison_job_runs_to_completion(cluster, mini_model_dir, tmp_path):
    """Every poison file, in one job per input contract (prompt source, its type, the id type:
    a file that differs from the first is schema drift, skipped whole): each row written once,
    each bad row with its error, the good rows generated; no replica restarts. The jobs run at
    once, from threads of this driver (each its own replica): most of a job is its replica
    starting."""
    groups: dict = {}
    for name, (table, words) in poison_files().items():
        if name == "ids":
            words = [w for _, w in ID_ROWS]
        src = next(c for c in ("prompt_token_ids", "messages", "prompt") if c in table.column_names)
        key = (src, str(table.schema.field(src).type), str(table.schema.field("id").type))
        groups.setdefault(key, []).append((name, table, words))
    jobs = []  # (spec, (id, error words) of every row)
    for g, files in enumerate(groups.values()):
        inp = tmp_path / f"in{g}"
        inp.mkdir()
        expected = []
        for name, table, words in files:
            pq.write_table(table, inp / f"{name}.parquet")
            expected += zip(table.column("id").to_pylist(), words)
        spec = JobSpec(
            model=mini_model_dir,
            name=f"poison-{g}",
            input=InputSpec(path=str(inp), batch_rows=64),
            output=OutputSpec(path=str(tmp_path / f"out{g}")),
            sampling=GREEDY,
            replicas=ReplicaSpec(device="cpu", max_inflight_rows=16, max_retries=1),
            engine=EngineConfig(max_num_seqs=8, max_seq_len=MAX_SEQ_LEN, chunk_size=32),
        )
        jobs.append((spec, expected))
    with ThreadPoolExecutor(len(jobs)) as pool:
        reports = list(pool.map(run_job, [spec for spec, _ in jobs]))
    for (spec, expected), report in zip(jobs, reports):
        rows = {}  # id -> output rows, in input order (one shard per file here)
        for shard in sorted(Path(spec.output.path).glob("*.parquet")):  # schemas differ
            for row in pq.read_table(shard, columns=["id", "error", "finish_reason"]).to_pylist():
                rows.setdefault(row["id"], []).append(row)
        assert sorted(rows, key=str) == sorted({i for i, _ in expected}, key=str), spec.name
        for rid, words in expected:
            row = rows[rid].pop(0)
            if words is None:
                assert row["error"] is None, (rid, row["error"])
                assert row["finish_reason"] in ("stop", "length"), rid
            else:
                assert row["finish_reason"] == "error", rid
                assert words in row["error"], (rid, row["error"])
        assert not any(rows.values()), f"rows written twice: {rows}"
        assert report.replica_failures == 0 and report.rows_retried == 0
        assert report.rows_with_error == sum(w is not None for _, w in expected)
        assert not report.unreadable_inputs


def test_stop_column_takes_lists_of_strings():
    assert row_sampling(GREEDY, {"stop": ["\n\n", "Q:"]}).stop == ("\n\n", "Q:")
    for bad in ("\n", [""], [1], [["x"]], {"s": "x"}):
        with pytest.raises(ValueError, match="stop = "):
            row_sampling(GREEDY, {"stop": bad})
