"""k3batch: distributed batch inference for the Kimi K3 model family, on Ray."""
