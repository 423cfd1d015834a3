"""Records every kernel launch the interpreter runs, for `test_sm90_compile` (`sm90.py`)."""

import json
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


def pytest_sessionfinish(session):
    """K3_SM90_SPECS=path: write the recorded launches there (for `sm90.py --sass`)."""
    path = os.environ.get("K3_SM90_SPECS")
    if path and RECORDER.specs:
        with open(path, "w") as f:
            json.dump(list(RECORDER.specs.values()), f)
