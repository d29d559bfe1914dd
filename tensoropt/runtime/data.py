"""Global training batches: the shared synthetic generator and ``--data`` files.

:func:`make_batch` is THE synthetic data generator of the project. The
distributed runtime (``tensoropt run``) and the single-device trainer
(``tensoropt train``) both call it, so both see bit-identical global batches for
the same (specs, step index, seed). Its definition, which must not change
without bumping :data:`SYNTHETIC_VERSION`:

* each input has its own stream ``numpy.random.default_rng([seed, step, crc32(name)])``
  (the order of ``specs`` therefore does not matter);
* integer inputs with a known bound (labels, indices into a table): uniform integers
  in ``[0, high)``, drawn as int64 and cast to the input's dtype;
* integer inputs without a bound and bool inputs (attention masks, flags): all ones;
* float inputs (and float labels): standard normal, drawn as float32 and cast.

Build the specs with :func:`specs_from_manifest` (runtime) or
:func:`specs_from_model` (single-device training-step graph); both give the same
specs for the same model as long as ``high`` bounds agree.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnx
from onnx import numpy_helper

from tensoropt.errors import DataError
from tensoropt.runtime.manifest import InputKind, Manifest

SYNTHETIC_VERSION = 1


@dataclass(frozen=True, slots=True)
class InputSpec:
    """What a global batch holds for one data input or the labels."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name, e.g. "float32", "int64"
    high: int | None = None  # exclusive bound for integer inputs (None -> 2)


def make_batch(specs: Sequence[InputSpec], step_index: int, seed: int) -> dict[str, np.ndarray]:
    """The synthetic global batch of one step (see the module docstring for the rule)."""
    batch: dict[str, np.ndarray] = {}
    for spec in specs:
        rng = np.random.default_rng([seed, step_index, zlib.crc32(spec.name.encode())])
        dtype = np.dtype(spec.dtype)
        if _all_ones(spec):
            # Integer inputs that index no table (attention masks, flags): all ones, the
            # "attend everywhere" mask a user means when giving no data.
            batch[spec.name] = np.ones(spec.shape, dtype=dtype)
        elif np.issubdtype(dtype, np.integer):
            draw = rng.integers(0, spec.high, size=spec.shape, dtype=np.int64)
            batch[spec.name] = draw.astype(dtype)
        else:
            draw = rng.standard_normal(size=spec.shape, dtype=np.float32)
            batch[spec.name] = draw.astype(dtype)
    return batch


def _all_ones(spec: InputSpec) -> bool:
    dtype = np.dtype(spec.dtype)
    return dtype == np.bool_ or (np.issubdtype(dtype, np.integer) and spec.high is None)


def ones_fed(specs: Sequence[InputSpec]) -> list[str]:
    """The inputs :func:`make_batch` feeds all ones (bool, and integers of no bound)."""
    return [s.name for s in specs if _all_ones(s)]


def not_finite_warning(
    command: str, losses: Sequence[float], specs: Sequence[InputSpec], synthetic: bool
) -> str | None:
    """The warning line when a loss is NaN or infinite (None when every loss is finite);
    on a ``synthetic`` batch it names the inputs fed all ones (bool and unbounded integer
    inputs: an attention mask that attends everywhere reads them so; a padding mask reads
    them as every key masked)."""
    bad = next((k for k, loss in enumerate(losses) if not math.isfinite(loss)), None)
    if bad is None:
        return None
    line = f"{command}: warning: the loss is {losses[bad]} from step {bad}"
    fed = ones_fed(specs) if synthetic else []
    if fed:
        names = ", ".join(repr(n) for n in fed)
        line += (
            f"; the synthetic batch feeds {names} all ones, which a padding mask reads as "
            "every position masked: give real inputs with --data FILE.npz"
        )
    return line


def step_highs(step: Mapping[str, Any]) -> dict[str, int]:
    """Integer bounds recorded in a ``tensoropt.step`` JSON (input_high, labels_high)."""
    highs = {str(k): int(v) for k, v in (step.get("input_high") or {}).items()}
    if step.get("labels") and step.get("labels_high") is not None:
        highs[str(step["labels"])] = int(step["labels_high"])
    return highs


def specs_from_manifest(manifest: Manifest) -> list[InputSpec]:
    """Specs of the global data inputs and labels of a compiled output directory.

    ``high`` comes from manifest["inputs"][name]["high"], else from the step JSON.
    """
    highs = step_highs(manifest.step)
    return [
        InputSpec(
            i.name, i.global_shape, i.dtype, i.high if i.high is not None else highs.get(i.name)
        )
        for i in manifest.inputs_of(InputKind.DATA, InputKind.LABELS)
    ]


def specs_from_model(model: onnx.ModelProto, step: Mapping[str, Any]) -> list[InputSpec]:
    """Specs of a single-device training-step graph, given its ``tensoropt.step`` JSON."""
    names = list(step.get("data_inputs", []))
    if step.get("labels"):
        names.append(step["labels"])
    highs = step_highs(step)
    by_name = {i.name: i for i in model.graph.input}
    specs = []
    for name in names:
        tt = by_name[name].type.tensor_type
        shape = tuple(int(d.dim_value) for d in tt.shape.dim)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name
        specs.append(InputSpec(name, shape, dtype, highs.get(name)))
    return specs


def input_specs(model: onnx.ModelProto, signature: Any) -> list[InputSpec]:
    """:func:`specs_from_model` for a :class:`~tensoropt.passes.training_step.StepSignature`."""
    return specs_from_model(model, signature.to_json())


def batch_source(
    specs: Sequence[InputSpec], data: str | Path | None, seed: int, steps: int | None = None
) -> Callable[[int], dict[str, np.ndarray]]:
    """``step index -> global batch``: synthetic (seeded) or from a ``--data`` file."""
    if data is None:
        return SyntheticSource(tuple(specs), seed).batch
    return load_npz(data, specs, steps).batch


class BatchSource(Protocol):
    """Where global batches come from; ``batch(step)`` is keyed by global step index."""

    def batch(self, step_index: int) -> dict[str, np.ndarray]: ...


@dataclass(frozen=True, slots=True)
class SyntheticSource:
    specs: tuple[InputSpec, ...]
    seed: int = 0

    def batch(self, step_index: int) -> dict[str, np.ndarray]:
        return make_batch(self.specs, step_index, self.seed)


@dataclass(frozen=True, slots=True, eq=False)
class NpzSource:
    """Batches from an ``.npz``: per array either ``[steps, *global]`` or ``global``."""

    path: Path
    arrays: Mapping[str, np.ndarray]
    per_step: Mapping[str, bool]

    def batch(self, step_index: int) -> dict[str, np.ndarray]:
        out = {}
        for name, a in self.arrays.items():
            if not self.per_step[name]:
                out[name] = a
                continue
            if step_index >= a.shape[0]:
                raise DataError(
                    f"{self.path}: array {name!r} holds {a.shape[0]} steps; step "
                    f"{step_index} needs at least {step_index + 1}"
                )
            out[name] = a[step_index]
        return out


def load_npz(path: str | Path, specs: Sequence[InputSpec], steps: int | None = None) -> NpzSource:
    """Load and check a ``--data`` file (for ``steps`` global steps 0..steps-1 if given)."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: --data is a directory; give an .npz file")
    if not path.is_file():
        raise DataError(f"{path}: --data file not found")
    try:
        with np.load(path, allow_pickle=False) as npz:
            raw = {k: npz[k] for k in npz.files}
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: not a readable .npz file ({exc})") from exc
    arrays: dict[str, np.ndarray] = {}
    per_step: dict[str, bool] = {}
    for spec in specs:
        arrays[spec.name], per_step[spec.name] = _check_array(path, raw, spec, steps)
    return NpzSource(path, arrays, per_step)


def _check_array(
    path: Path, raw: Mapping[str, np.ndarray], spec: InputSpec, steps: int | None
) -> tuple[np.ndarray, bool]:
    if spec.name not in raw:
        raise DataError(
            f"{path}: no array {spec.name!r}; expected shape {list(spec.shape)} or "
            f"[steps, {', '.join(map(str, spec.shape))}] (arrays found: {sorted(raw)})"
        )
    a = raw[spec.name]
    target = np.dtype(spec.dtype)
    if not np.can_cast(a.dtype, target, casting="same_kind"):
        raise DataError(
            f"{path}: array {spec.name!r} has dtype {a.dtype}, expected {target} (or a "
            "dtype of the same kind)"
        )
    a = a.astype(target, copy=False)
    if a.shape == spec.shape:
        return a, False
    if a.shape[1:] == spec.shape:
        if steps is not None and a.shape[0] < steps:
            raise DataError(
                f"{path}: array {spec.name!r} holds {a.shape[0]} steps, expected at least "
                f"{steps} (shape [{steps}, {', '.join(map(str, spec.shape))}])"
            )
        return a, True
    raise DataError(
        f"{path}: array {spec.name!r} has shape {list(a.shape)}, expected "
        f"{list(spec.shape)} or [steps, {', '.join(map(str, spec.shape))}]"
    )


# ops that carry an integer input's values unchanged (training_step._index_high follows
# the same ones to the Gather an input indexes): (op, data slots)
_CARRIERS = {
    "Reshape": (0,), "Slice": (0,), "Unsqueeze": (0,), "Squeeze": (0,), "Flatten": (0,),
    "Transpose": (0,), "Identity": (0,), "Expand": (0,), "Where": (1, 2),
}  # fmt: skip


def index_exceptions(models: Sequence[onnx.ModelProto], names: Sequence[str]) -> dict[str, set]:
    """Values outside ``[0, high)`` the graphs handle before indexing with them: the
    constants an input is compared with by ``Equal`` (a class loss's ``ignore_index``,
    which ``ir/canonical._class_loss`` replaces by a safe label and weighs 0)."""
    found: dict[str, set] = {name: set() for name in names}
    for model in models:
        graph = model.graph
        consts = {
            t.name: t for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL
        }
        for node in graph.node:
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
                consts[node.output[0]] = node.attribute[0].t
        users: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for i in node.input:
                users.setdefault(i, []).append(node)
        for name in names:
            todo, seen = [name], {name}
            while todo:
                value = todo.pop()
                for node in users.get(value, ()):
                    slots = [k for k, i in enumerate(node.input) if i == value]
                    if node.op_type == "Equal":
                        other = node.input[1 - slots[0]] if len(node.input) == 2 else ""
                        if other in consts:
                            array = numpy_helper.to_array(consts[other])
                            if array.size == 1:
                                found[name].add(int(array.reshape(-1)[0]))
                    elif any(k in _CARRIERS.get(node.op_type, ()) for k in slots):
                        for out in node.output:
                            if out and out not in seen:
                                seen.add(out)
                                todo.append(out)
    return found


def check_indices(
    source: NpzSource,
    specs: Sequence[InputSpec],
    steps: int | None = None,
    exceptions: Mapping[str, set] | None = None,
    labels: str | None = None,
) -> None:
    """Refuse integer data that indexes a table out of range: every input with a bound
    ``high`` (token ids into an embedding of ``high`` rows; ``labels`` of a loss over
    ``high`` classes) must hold values in ``[0, high)``, or one of its ``exceptions``.
    Per-step arrays are checked for the steps a run reads (``steps``)."""
    exceptions = exceptions or {}
    for spec in specs:
        a = source.arrays.get(spec.name)
        if a is None or spec.high is None or not np.issubdtype(a.dtype, np.integer):
            continue
        if source.per_step[spec.name] and steps is not None:
            a = a[:steps]
        bad = (a < 0) | (a >= spec.high)
        allowed = sorted(exceptions.get(spec.name, ()))
        for value in allowed:
            bad &= a != value
        if not bad.any():
            continue
        wrong = a[bad]
        what = (
            f"class labels of a loss over {spec.high} classes"
            if spec.name == labels
            else f"ids that index {spec.high} entries: a table's rows or a loss's classes"
        )
        also = f" or {', '.join(map(str, allowed))}" if allowed else ""
        raise DataError(
            f"{source.path}: array {spec.name!r} holds {wrong.size} value(s) in "
            f"[{wrong.min()}, {wrong.max()}], outside [0, {spec.high}){also} ({what}); "
            "fix the data"
        )
