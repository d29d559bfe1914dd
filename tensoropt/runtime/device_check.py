"""The runtime's collective-order pre-check over a set of device graphs, as one call.

The compile verifier (``tensoropt compile --verify-passes``) runs it on the device
graphs lowered from the local template, before anything is written, so a pass that
breaks group consistency is caught at compile time, not when a run deadlocks.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx

from tensoropt.runtime.program import check_collective_order
from tensoropt.runtime.split import collective_order


def check_device_graphs(devices: Mapping[int, onnx.ModelProto]) -> None:
    """Raise TensorOptError unless every rank issues matching collectives and groups."""
    world = len(devices)
    check_collective_order({r: collective_order(p, r, world) for r, p in devices.items()})
