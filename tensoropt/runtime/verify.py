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

A tensor whose exact gradient is zero holds rounding noise, and Adam divides its
update by the gradient's own size: such a tensor moves by up to ``lr`` per step in a
direction set by rounding (gpt's attention key bias: softmax is invariant to it). No
reduction order reproduces another's there, so when a parameter is over the tolerance
the reference measures its own *rounding sensitivity*: the same training with the
batch's samples reversed, which changes only the order of the gradient sums
(:meth:`Reference.step_and_compare`). That is a whole second trajectory from the first
step, since a parameter moved by rounding changes every later gradient a little: with
Adam (states ``*__v``) followed from the first step; with SGD replayed from the first
step's state over the kept batches when a parameter first goes over the tolerance (a
model whose batch norms amplify rounding step by step, ResNet-50 small, needs it), and
past ``MAX_REPLAY`` steps a single reversed step from the same state, summed over the
steps. A parameter is still within the check when its error is at most
``SENSITIVITY_SLACK`` times its sensitivity; the report names such parameters. A
parameter with a real gradient is sensitive at the 1e-6 level, so the tolerance keeps
deciding there, and a wrong update (``lr`` per step, against a noise of about ``lr`` x
1e-3 for the key bias) stays far outside its allowance.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tensoropt.ir.vocab import OptimizerState

TINY = 1e-12
DEFAULT_TOLERANCE = 1e-4


SCALE_FLOOR = 1e-3
SENSITIVITY_SLACK = 4.0  # a reduction order may differ more than one reordering does
# SGD keeps the batches of at most this many steps to replay the reversed-sample
# trajectory when a parameter first goes over the tolerance; past it, one reversed step
# per step from the reference's state measures the sensitivity
MAX_REPLAY = 256


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
    # parameter -> the error its rounding sensitivity allows (module docstring); only
    # parameters whose error is over the tolerance are measured
    allowed_params: Mapping[str, float] = field(default_factory=dict)

    @property
    def max_rel_error_params(self) -> float:
        return max(self.rel_error_params.values(), default=0.0)

    def within(self, tolerance: float) -> bool:
        """Loss and every parameter within the tolerance, or a parameter within its
        rounding allowance."""
        if not (np.isfinite(self.rel_error_loss) and self.rel_error_loss <= tolerance):
            return False
        return all(
            np.isfinite(e) and e <= max(tolerance, self.allowed_params.get(name, 0.0))
            for name, e in self.rel_error_params.items()
        )

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "loss": self.loss,
            "reference_loss": self.reference_loss,
            "rel_error_loss": self.rel_error_loss,
            "max_rel_error_params": self.max_rel_error_params,
            "rel_error_params": dict(self.rel_error_params),
            "allowed_params": dict(self.allowed_params),
        }

    @staticmethod
    def from_json(d: Mapping) -> VerifyStep:
        return VerifyStep(
            d["step"],
            d["loss"],
            d["reference_loss"],
            d["rel_error_loss"],
            d["rel_error_params"],
            d.get("allowed_params", {}),
        )


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
        return all(s.within(self.tolerance) for s in self.per_step)

    @property
    def noise_params(self) -> dict[str, float]:
        """Parameters over the tolerance but within their rounding allowance: name ->
        their largest error."""
        out: dict[str, float] = {}
        for s in self.per_step:
            for name, limit in s.allowed_params.items():
                e = s.rel_error_params.get(name, 0.0)
                if self.tolerance < e <= limit:
                    out[name] = max(out.get(name, 0.0), e)
        return out

    def to_json(self) -> dict:
        return {
            "max_rel_error_loss": self.max_rel_error_loss,
            "max_rel_error_params": self.max_rel_error_params,
            "per_step": [s.to_json() for s in self.per_step],
            "ok": self.ok,
            "tolerance": self.tolerance,
            "within_rounding_sensitivity": self.noise_params,
        }


@dataclass(slots=True)
class Reference:
    """The unpartitioned step and its state; ``state`` may be replaced (resume)."""

    session: object
    state: dict[str, np.ndarray] = field(default_factory=dict)
    tolerance: float = DEFAULT_TOLERANCE
    # parameter -> its rounding sensitivities summed over the steps measured so far
    sensitivity: dict[str, float] = field(default_factory=dict)
    # a second reference trajectory, every step's samples reversed, from the state of
    # the first step compared: from that step on with an adaptive optimizer; with SGD
    # replayed from ``replay`` when a parameter is first over the tolerance
    shadow: dict[str, np.ndarray] | None = None
    # SGD, until the shadow starts: the batches since the first step compared (None past
    # MAX_REPLAY steps: one reversed step per step instead) and the state before it
    replay: list[dict[str, np.ndarray]] | None = field(default_factory=list)
    replay_start: dict[str, np.ndarray] | None = None

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
        """Advance the reference by one step and compare with the distributed values;
        measure the rounding sensitivity of the parameters over the tolerance."""
        before = self.state
        ref_loss, self.state = self.session.step(before, batch)  # type: ignore[attr-defined]
        adaptive = _adaptive(before)
        reordered = None
        if adaptive or self.shadow is not None:
            # the divergence compounds from step to step (a parameter moved by rounding
            # changes every later gradient a little): follow a whole second trajectory
            reordered = _reordered(batch)
            if reordered is not None:
                start = self.shadow if self.shadow is not None else before
                _, self.shadow = self.session.step(start, reordered)  # type: ignore[attr-defined]
        elif self.replay is not None:
            if self.replay_start is None:
                self.replay_start = _copied(before)
            self.replay.append(_copied(batch))
            if len(self.replay) > MAX_REPLAY:
                self.replay, self.replay_start = None, None
        floor = param_floor({name: self.state[name] for name in params})
        errors = {name: rel_error(value, self.state[name], floor) for name, value in params.items()}
        over = [name for name, e in errors.items() if e > self.tolerance]
        allowed: dict[str, float] = {}
        if over and self.shadow is None and not adaptive and self.replay:
            self.shadow = self._replayed()
            self.replay, self.replay_start = None, None
        if over and self.shadow is not None:
            for name in over:
                felt = rel_error(self.shadow[name], self.state[name], floor)
                allowed[name] = SENSITIVITY_SLACK * felt
        elif over and not adaptive and (reordered := _reordered(batch)) is not None:
            _, other = self.session.step(before, reordered)  # type: ignore[attr-defined]
            for name in over:
                felt = rel_error(other[name], self.state[name], floor)
                self.sensitivity[name] = self.sensitivity.get(name, 0.0) + felt
                allowed[name] = SENSITIVITY_SLACK * self.sensitivity[name]
        return VerifyStep(step, loss, float(ref_loss), rel_error(loss, ref_loss), errors, allowed)

    def _replayed(self) -> dict[str, np.ndarray] | None:
        """The reversed-sample trajectory from the first state over every batch so far;
        None when a batch cannot be reordered."""
        state = self.replay_start
        for batch in self.replay or ():
            reordered = _reordered(batch)
            if reordered is None:
                return None
            _, state = self.session.step(state, reordered)  # type: ignore[attr-defined]
        return state


def _copied(values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.array(v, copy=True) for k, v in values.items()}


def _adaptive(state: Mapping[str, np.ndarray]) -> bool:
    """Whether the step's optimizer divides updates by a second moment (Adam: states
    named ``*__v``), which turns the rounding of small gradients into whole updates."""
    return any(name.endswith(OptimizerState.ADAM_V.value) for name in state)


def _reordered(batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """The batch with its samples in another order (reversed; a fixed order keeps runs
    reproducible): every input that has the batch's leading dimension is reordered
    alike. None when the batch has fewer than two samples."""
    sizes = {v.shape[0] for v in batch.values() if np.ndim(v) > 0}
    if len(sizes) != 1:
        return None
    (n,) = sizes
    if n < 2:
        return None
    return {k: (v[::-1].copy() if np.ndim(v) > 0 else v) for k, v in batch.items()}
