from k3batch.model.config import FLAVORS, K3Config, get_flavor
from k3batch.model.k3 import K3Model

__all__ = ["FLAVORS", "K3Config", "K3Model", "get_flavor"]
