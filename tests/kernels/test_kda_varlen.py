"""`k3kernels.kda.varlen`: the per-forward offsets and chunk tables equal what fla computes
from the offsets itself (`prepare_chunk_indices`, `prepare_chunk_offsets`), and the kernels'
functions take either a plain list or a `Varlen`."""

import pytest
import torch
from k3kernels.kda.varlen import CHUNK_SIZE, Varlen, as_varlen, make_varlen


def _offsets(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


@pytest.mark.parametrize("lens", [[1], [64], [65, 1, 130], [63, 64, 200, 7]],
                         ids=["T1", "T64", "B3-uneven", "B4-uneven"])  # fmt: skip
def test_varlen_matches_fla_tables(lens):
    pytest.importorskip("fla")
    from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets

    offsets = _offsets(lens)
    v = make_varlen(offsets, "cpu")
    assert isinstance(v, list) and list(v) == offsets
    cu = torch.tensor(offsets)
    assert torch.equal(v.cu, cu) and torch.equal(v.cu_cpu, cu)
    assert torch.equal(v.chunk_indices, prepare_chunk_indices(cu, CHUNK_SIZE))
    assert torch.equal(v.chunk_offsets, prepare_chunk_offsets(cu, CHUNK_SIZE))
    assert v.max_len == max(lens)


def test_as_varlen_reuses_a_varlen_on_its_device():
    v = make_varlen([0, 3, 10], "cpu")
    assert as_varlen(v, torch.device("cpu")) is v
    built = as_varlen([0, 3, 10], "cpu")
    assert isinstance(built, Varlen) and torch.equal(built.cu, v.cu)
