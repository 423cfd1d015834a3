"""IdIndex: the first occurrence of an id in input order, from the id columns alone, on disk."""

import pyarrow as pa
import pyarrow.parquet as pq

from k3batch.driver.ids import IdIndex, id_strings, position
from k3batch.io import resolve_input


def test_id_index_first_occurrence_in_input_order(tmp_path):
    pq.write_table(pa.table({"id": ["a", "b", "a", None]}), tmp_path / "0.parquet")
    pq.write_table(pa.table({"id": ["c", "b", "c"]}), tmp_path / "1.parquet", row_group_size=1)
    fs, files = resolve_input(str(tmp_path))
    index = IdIndex.build(fs, files, "id")
    try:
        assert index.num_rows == 6  # the null id is not indexed
        # lookups in any order, repeated ids, unknown ids
        got = index.first_positions(["c", "a", "zz", "b", "c"])
        assert got == {"a": position(0, 0), "b": position(0, 1), "c": position(1, 0)}
    finally:
        index.close()


def test_id_strings_integer_ids_match_python_str():
    col = pa.chunked_array([pa.array([1, None, 30], pa.int32())])
    assert id_strings(col) == ["1", None, "30"]
