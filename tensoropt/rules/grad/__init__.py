"""Per-op gradient rules.

``GRAD_RULES`` is the one registry the autodiff pass uses; it is built here from
an explicit list of op-family modules, each of which adds its rules through
``register_into(registry)``. Nothing else happens at import time.
"""

from __future__ import annotations

from tensoropt.rules.grad import conv, elementwise, gather, matmul, misc, nn, reduce, shape
from tensoropt.rules.grad.api import GradContext, GradRegistry, GradRule

_FAMILIES = (elementwise, matmul, reduce, shape, gather, nn, conv, misc)


def build_registry() -> GradRegistry:
    """A fresh registry holding every gradient rule of this package."""
    registry = GradRegistry()
    for family in _FAMILIES:
        family.register_into(registry)
    return registry


GRAD_RULES: GradRegistry = build_registry()

__all__ = ["GRAD_RULES", "GradContext", "GradRegistry", "GradRule", "build_registry"]
