import pytest
import torch

from k3batch.model import K3Model, get_flavor
from k3batch.model.init import init_random_

# The tiny CPU models are bound by per-op overhead; one intra-op thread avoids spin contention
# on small CI machines.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_factory():
    """Cached fp32 random-weight models by flavor name (seed 0), in eval mode."""
    cache = {}

    def get(flavor: str) -> K3Model:
        if flavor not in cache:
            model = K3Model(get_flavor(flavor), dtype=torch.float32)
            cache[flavor] = init_random_(model, seed=0).eval()
        return cache[flavor]

    return get
