"""Package attributes imported on first use (a module `__getattr__`, PEP 562), so that a process
which imports one light module of a package (a tokenize task, a fake replica, the `k3batch
run` driver) does not load torch through that package's `__init__`."""

import importlib


def lazy_attributes(package: str, **homes: str):
    """A `__getattr__` for `package`: each name in `homes` is imported from the module named
    there when first read."""

    def __getattr__(name: str):
        if name in homes:
            return getattr(importlib.import_module(homes[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
