"""Public names of a package imported on first use (PEP 562).

A package whose ``__init__`` would import heavy dependencies (the solver's numba and
kernels, onnx and the zoo's builders) names where each public name lives instead; the
CLI's parsers then read a constant of one submodule without importing the rest.
"""

import importlib
import sys
from collections.abc import Callable


def names_on_first_use(package: str, where: dict[str, str]) -> Callable[[str], object]:
    """The module ``__getattr__`` of ``package``: name -> the submodule (relative to the
    package) that defines it. A name is imported once and then kept in the package."""

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
