"""k3batch: distributed batch inference for the Kimi K3 model family, on Ray."""


def __getattr__(name: str):
    """`k3batch.load_model`, imported on first use: a process that imports only a light module
    of the package (a tokenize task, a fake replica) does not load torch."""
    if name == "load_model":
        from k3batch.model.loader import load_model

        return load_model
    raise AttributeError(f"module 'k3batch' has no attribute {name!r}")
