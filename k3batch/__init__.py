"""k3batch: distributed batch inference for the Kimi K3 model family, on Ray."""

from k3batch.model.loader import load_model  # noqa: F401  (re-export: k3batch.load_model)
