"""The fault tests join the shared local Ray head like tests/conftest.py's `cluster`, with
retries: on a loaded machine that runs other Ray instances, the head's raylet can register after
ray.init's node lookup has given up."""

import time

import pytest
import ray


@pytest.fixture(scope="module")
def cluster(ray_head):
    for attempt in range(3):
        try:
            ray.init(address=ray_head.gcs_address)
            break
        except ConnectionError:
            ray.shutdown()
            if attempt == 2:
                raise
            time.sleep(5)
    yield ray_head
    ray.shutdown()
