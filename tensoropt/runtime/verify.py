"""``--verify``: compare a distributed run with the unpartitioned training step.

The reference is ``annotated.onnx`` of the output directory (a normal training
step with no collectives) run by :class:`tensoropt.runtime.single.StepSession` on
the same global batches. After each step the loss and every parameter (gathered
from the rank shards) are compared with

    rel_error(a, b) = max_i |a_i - b_i| / max(max_i |b_i|, TINY),   TINY = 1e-12,

computed in float64, where ``a`` is the distributed value and ``b`` the reference.
For parameters the denominator is floored at 1e-3 of the model's largest parameter
magnitude (see :func:`param_floor`: tensors whose exact gradient is zero hold only
rounding noise). The loss uses TINY.
It is a norm-wise (infinity-norm) relative error: elementwise relative error would
blow up on entries that happen to be near zero. The verdict is ``ok`` when every
value at every step is within the tolerance (default 1e-4, float32 territory).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TINY = 1e-12
DEFAULT_TOLERANCE = 1e-4


SCALE_FLOOR = 1e-3


def rel_error(a: np.ndarray | float, b: np.ndarray | float, floor: float = TINY) -> float:
    """max|a - b| / max(max|b|, floor), in float64 (see the module docstring)."""
    a64 = np.asarray(a, dtype=np.float64)
    b64 = np.asarray(b, dtype=np.float64)
    if a64.shape != b64.shape:
        return float("inf")
    if a64.size == 0:
        return 0.0
    return float(np.max(np.abs(a64 - b64)) / max(float(np.max(np.abs(b64))), floor, TINY))


def param_floor(params: Mapping[str, np.ndarray]) -> float:
    """SCALE_FLOOR times the largest parameter magnitude of the model.

    A parameter whose true gradient is exactly zero (e.g. a key bias: softmax is
    invariant to it) stays at its initial value plus float32 rounding noise of the
    gradient sums; a plain per-tensor relative error of such a tensor compares two
    noises. Measuring each tensor's error against at least 1e-3 of the model's
    parameter scale keeps the check meaningful for every other tensor (their own
    magnitude is larger) without hiding real differences.
    """
    largest = max((float(np.max(np.abs(v))) for v in params.values() if v.size), default=0.0)
    return SCALE_FLOOR * largest


@dataclass(frozen=True, slots=True)
class VerifyStep:
    step: int
    loss: float
    reference_loss: float
    rel_error_loss: float
    rel_error_params: Mapping[str, float]

    @property
    def max_rel_error_params(self) -> float:
        return max(self.rel_error_params.values(), default=0.0)

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "loss": self.loss,
            "reference_loss": self.reference_loss,
            "rel_error_loss": self.rel_error_loss,
            "max_rel_error_params": self.max_rel_error_params,
            "rel_error_params": dict(self.rel_error_params),
        }


@dataclass(frozen=True, slots=True)
class VerifyReport:
    per_step: tuple[VerifyStep, ...]
    tolerance: float = DEFAULT_TOLERANCE

    @property
    def max_rel_error_loss(self) -> float:
        return max((s.rel_error_loss for s in self.per_step), default=0.0)

    @property
    def max_rel_error_params(self) -> float:
        return max((s.max_rel_error_params for s in self.per_step), default=0.0)

    @property
    def ok(self) -> bool:
        worst = max(self.max_rel_error_loss, self.max_rel_error_params)
        return bool(np.isfinite(worst)) and worst <= self.tolerance

    def to_json(self) -> dict:
        return {
            "max_rel_error_loss": self.max_rel_error_loss,
            "max_rel_error_params": self.max_rel_error_params,
            "per_step": [s.to_json() for s in self.per_step],
            "ok": self.ok,
            "tolerance": self.tolerance,
        }


@dataclass(slots=True)
class Reference:
    """The unpartitioned step and its state; ``state`` may be replaced (resume)."""

    session: object
    state: dict[str, np.ndarray] = field(default_factory=dict)

    @staticmethod
    def open(outdir: Path, threads: int | None = None, arena=None) -> Reference:
        """The reference over ``annotated.onnx``; ``arena`` as the rank's segments use
        (the shared arena lets the reference step reuse the memory the rank's step
        freed, so rank 0 holds the larger of the two peaks, not their sum)."""
        from tensoropt.runtime.single import StepSession

        session = StepSession(outdir / "annotated.onnx", threads=threads, arena=arena)
        return Reference(session, session.initial_state())

    def step_and_compare(
        self,
        step: int,
        batch: Mapping[str, np.ndarray],
        loss: float,
        params: Mapping[str, np.ndarray],
    ) -> VerifyStep:
        """Advance the reference by one step and compare with the distributed values."""
        ref_loss, self.state = self.session.step(self.state, batch)  # type: ignore[attr-defined]
        floor = param_floor({name: self.state[name] for name in params})
        errors = {name: rel_error(value, self.state[name], floor) for name, value in params.items()}
        return VerifyStep(step, loss, float(ref_loss), rel_error(loss, ref_loss), errors)
