"""Records every kernel launch the interpreter runs, for `test_sm90_compile` (`sm90.py`)."""

import os

import pytest
from sm90 import Recorder

RECORDER = Recorder()
if os.environ.get("TRITON_INTERPRET") == "1":
    RECORDER.install()

LAST = "test_kernels_compile_for_sm90"


@pytest.fixture(scope="session")
def sm90_recorder() -> Recorder:
    return RECORDER


def pytest_collection_modifyitems(items):
    """The sm_90 compile check runs after every other test: it compiles what they launched."""
    items.sort(key=lambda item: item.name == LAST)  # stable: the rest keep their order
