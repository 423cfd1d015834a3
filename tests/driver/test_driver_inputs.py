"""The input survey (schema drift, issue 11 defect 3) and the end-of-run account of rows with no
output (defect 4), without Ray. Both are new: the old driver checked only the first file's schema
(a later drifting file crashed it) and never compared the committed shards with the input."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from k3batch.driver.commit import missing_rows
from k3batch.driver.inputs import survey_inputs
from k3batch.io import resolve_input
from k3batch.driver.jobspec import InputSpec


def _write(path, **cols):
    pq.write_table(pa.table(cols), path)


def test_survey_checks_every_file_against_the_first_valid_one(tmp_path):
    _write(tmp_path / "0-no-prompt.parquet", id=["a"], text=["x"])  # before the first valid
    _write(tmp_path / "1.parquet", id=["b"], prompt=["x"])
    _write(tmp_path / "2-no-id.parquet", prompt=["x"])
    _write(tmp_path / "3-int-ids.parquet", id=pa.array([7], pa.int16()), prompt=["x"])
    _write(tmp_path / "4-large.parquet", id=pa.array(["c"], pa.large_string()), prompt=["x"])
    _write(tmp_path / "5-clash.parquet", id=["e"], prompt=["x"], finish_reason=["y"])
    (tmp_path / "6-garbage.parquet").write_bytes(b"PAR1 garbage")
    fs, files = resolve_input(str(tmp_path))
    survey = survey_inputs(fs, files, InputSpec(path=str(tmp_path)))
    assert survey.contract == {"prompt_column": "prompt", "prompt_type": "string",
                               "id_type": "string"}  # fmt: skip
    assert sorted(survey.bad) == [0, 2, 3, 5, 6]  # large_string ids are still string ids
    assert "no prompt column" in survey.bad[0]
    assert "id type none (the job's: 'string')" in survey.bad[2]
    assert "id type 'integer'" in survey.bad[3]
    assert "clash" in survey.bad[5] and "footer" in survey.bad[6]
    assert survey.num_rows == [1, 1, 1, 1, 1, 1, None]
    # A resume checks against the recorded contract, whatever the first valid file is now.
    again = survey_inputs(fs, files[2:], InputSpec(path=str(tmp_path)), survey.contract)
    assert 2 in again.bad and 4 not in again.bad


def test_survey_with_no_valid_file_fails_naming_the_problem(tmp_path):
    _write(tmp_path / "a.parquet", text=["x"])
    fs, files = resolve_input(str(tmp_path))
    with pytest.raises(ValueError, match="no prompt column"):
        survey_inputs(fs, files, InputSpec(path=str(tmp_path)))


def test_missing_rows_per_file_with_reasons(tmp_path):
    for name in "abc":
        _write(tmp_path / f"{name}.parquet", prompt=["x"])
    _, files = resolve_input(str(tmp_path))
    committed = {(0, 0), (0, 1), (0, 2), (1, 0)}
    reasons = {1: ["b.parquet: read error at row 4"]}
    # a: 5 rows in 3 batches of 2, all there; b: 5 rows, batches 1, 2 missing; c: never readable
    got = missing_rows(files, [5, 5, None], committed, 2, reasons)
    assert [(m["file"].rsplit("/", 1)[-1], m["rows"], m["batches"]) for m in got] == [
        ("b.parquet", 3, [1, 2]),
        ("c.parquet", None, []),
    ]
    assert got[0]["why"] == ["b.parquet: read error at row 4"]
    assert "not processed" in got[1]["why"][0]
