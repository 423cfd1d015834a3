"""k3batch: distributed batch inference for the Kimi K3 model family, on Ray."""

from k3batch._lazy import lazy_attributes

__getattr__ = lazy_attributes(__name__, load_model="k3batch.model.loader")  # torch on first use
