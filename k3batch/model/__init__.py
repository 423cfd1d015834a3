from k3batch.model.config import FLAVORS, K3Config, get_flavor

__all__ = ["FLAVORS", "K3Config", "K3Model", "get_flavor"]


def __getattr__(name: str):
    """`K3Model`, imported on first use: the config alone does not load torch."""
    if name == "K3Model":
        from k3batch.model.k3 import K3Model

        return K3Model
    raise AttributeError(f"module 'k3batch.model' has no attribute {name!r}")
