from k3batch._lazy import lazy_attributes
from k3batch.model.config import FLAVORS, K3Config, get_flavor

__all__ = ["FLAVORS", "K3Config", "K3Model", "get_flavor"]

__getattr__ = lazy_attributes(__name__, K3Model="k3batch.model.k3")  # torch on first use
