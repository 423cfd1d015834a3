"""The driver opens units by unfinished rows (`driver.loop.Loop.fill`), so the replicas keep
getting work while a few long rows hold units open, and driver memory stays bounded by
`max_open` units. No Ray: the loop's intake and commit are stubs.

Fails on the old rule (units open while fewer than max_open = 1 + windows / batch_rows are
open): with one long row left in each open unit, no unit opened and the replicas' windows
emptied while the input still had rows (a long-tail job ran at 0.947x the engine alone on a
simulated H100, `bench job --device sim`; 0.991x with this rule)."""

from types import SimpleNamespace

from k3batch.driver.intake import OpenUnit
from k3batch.driver.loop import Loop
from k3batch.driver.report import JobReport

BATCH_ROWS = 4


class _Intake:
    """Units of BATCH_ROWS rows of file 0, tokenized at once."""

    def __init__(self, num_units: int):
        self.batches, self.exhausted, self.tok_refs = iter(range(num_units)), False, {}

    def open_next(self) -> OpenUnit | None:
        b = next(self.batches, None)
        if b is None:
            self.exhausted = True
            return None
        return OpenUnit((0, b), None, [None] * BATCH_ROWS, [None] * BATCH_ROWS, BATCH_ROWS)


def _loop(num_units: int, *, rows_wanted: int, max_open: int) -> Loop:
    commit = SimpleNamespace(maybe_commit=lambda state: not state.remaining)
    return Loop(_Intake(num_units), None, None, commit, rows_wanted=rows_wanted,
                max_open=max_open, progress=None, report=JobReport("j", "out"))  # fmt: skip


def _unfinished(loop: Loop) -> int:
    return sum(u.remaining for u in loop.open.values())


def _finish_all_but_one(loop: Loop) -> None:
    """Every open unit's rows finish but its last (a long row)."""
    for state in loop.open.values():
        for i in range(BATCH_ROWS - 1):
            if state.results[i] is None:
                state.finish(i, {"error": None})


def test_units_open_until_the_windows_and_one_refill_are_covered():
    loop = _loop(100, rows_wanted=10, max_open=100)
    loop.fill()
    assert len(loop.open) == 3 and _unfinished(loop) == 12  # 10 wanted: the third unit too
    loop._finish([((0, 0, i), {"error": None}) for i in range(3)])
    loop.fill()
    assert len(loop.open) == 4 and _unfinished(loop) == 13  # 9 left: one more unit


def test_long_rows_holding_units_open_do_not_starve_the_replicas():
    loop = _loop(100, rows_wanted=8, max_open=6)
    loop.fill()
    assert len(loop.open) == 2
    _finish_all_but_one(loop)  # 2 rows left to run: the replicas would empty
    loop.fill()
    assert len(loop.open) == 4 and _unfinished(loop) == 10
    _finish_all_but_one(loop)
    loop.fill()
    assert len(loop.open) == 5 and _unfinished(loop) == 8
    _finish_all_but_one(loop)
    loop.fill()
    assert len(loop.open) == 6 and _unfinished(loop) == 9
    _finish_all_but_one(loop)
    loop.fill()  # 6 rows left, 8 wanted, but no unit more may open (driver memory)
    assert len(loop.open) == 6 and loop.report.peak_open_units == 6
    loop._finish([((0, b, BATCH_ROWS - 1), {"error": None}) for b in (0, 1)])
    assert len(loop.open) == 4  # their long rows done, the two units committed
    loop.fill()
    assert len(loop.open) == 5 and _unfinished(loop) == 8


def test_a_short_input_opens_what_there_is():
    loop = _loop(2, rows_wanted=100, max_open=100)
    loop.fill()
    assert len(loop.open) == 2 and loop.intake.exhausted
