"""The compile pipeline: training step + plan -> an output directory.

``annotate -> annotated.onnx (IRv11 sharding specs) -> insert_redistribution ->
localize -> lower_for_rank (per rank) -> device_<k>.onnx + plan.json +
manifest.json``. The directory is written completely or not at all: everything
goes to a temporary sibling directory that is renamed into place at the end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

from tensoropt.errors import OutputDirError
from tensoropt.ir.builder import static_shape
from tensoropt.ir.layout import Layout, Partial, Shard
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.plan import Plan, UnitStrategy
from tensoropt.ir.vocab import COLLECTIVE_DOMAIN
from tensoropt.passes import pipeline
from tensoropt.passes.annotate import Annotation
from tensoropt.passes.infra import CompileState
from tensoropt.passes.partition import lower_for_rank
from tensoropt.passes.training_step import TrainingStep

log = logging.getLogger(__name__)

MANIFEST_SCHEMA = "tensoropt.manifest/1"


@dataclass(frozen=True, slots=True)
class CompileResult:
    outdir: str
    world_size: int
    files: tuple[str, ...]
    collectives: int


def _sharding_annotations(proto: onnx.ModelProto, ann: Annotation, names: Mapping) -> None:
    """ONNX IRv11 multi-device annotations: one ShardingSpec per sharded node input/output."""
    mesh = ann.mesh
    proto.ir_version = max(proto.ir_version, 11)
    config = proto.configuration.add()
    config.name = "tensoropt"
    config.num_devices = mesh.size
    config.device.extend(f"rank{r}" for r in range(mesh.size))
    by_name = {n.name: n for n in proto.graph.node}
    for node, strategy in ann.strategies.items():
        pnode = by_name.get(node.name)
        if pnode is None:
            continue
        specs = []
        for value, layout in [
            *zip(node.inputs, strategy.inputs, strict=False),
            *zip(node.outputs, strategy.outputs, strict=False),
        ]:
            if value is None or layout is None or not _sharded(layout):
                continue
            specs.append(_spec(value.name, layout, mesh))
        if specs:
            dc = pnode.device_configurations.add()
            dc.configuration_id = "tensoropt"
            dc.sharding_spec.extend(specs)


def _sharded(layout: Layout) -> bool:
    return any(isinstance(p, Shard) for p in layout.placements)


def _spec(name: str, layout: Layout, mesh: Mesh) -> onnx.ShardingSpecProto:
    spec = onnx.ShardingSpecProto()
    spec.tensor_name = name
    spec.device.extend(range(mesh.size))
    shards: dict[int, int] = {}
    for axis, p in enumerate(layout.placements):
        if isinstance(p, Shard):
            shards[p.dim] = shards.get(p.dim, 1) * mesh.shape[axis]
    for dim, count in sorted(shards.items()):
        sd = spec.sharded_dim.add()
        sd.axis = dim
        simple = sd.simple_sharding.add()
        simple.num_shards = count
    return spec


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _global_values(graph: ir.Graph, names: Sequence[str]) -> dict[str, np.ndarray]:
    return {n: graph.initializers[n].const_value.numpy() for n in names}


def _io_entry(value: ir.Value, layout: Layout, kind: str | None, high: int | None) -> dict:
    entry = {
        "global_shape": list(static_shape(value)),
        "dtype": value.dtype.numpy().name,
        "placements": [str(p) for p in layout.placements],
    }
    if kind is not None:
        entry["kind"] = kind
    if high is not None:
        entry["high"] = high
    return entry


def _manifest(step: TrainingStep, ann: Annotation, graph: ir.Graph, layouts, files) -> dict:
    sig = step.signature
    kinds = {n: "data" for n in sig.data_inputs}
    if sig.labels:
        kinds[sig.labels] = "labels"
    kinds.update({n: "param" for n in sig.params})
    kinds.update({n: "state" for n in sig.states})
    highs = dict(sig.input_high)
    if sig.labels and sig.labels_high is not None:
        highs[sig.labels] = sig.labels_high
    mesh = ann.mesh
    return {
        "schema": MANIFEST_SCHEMA,
        "world_size": mesh.size,
        "mesh": mesh.to_json(),
        "ranks": [
            {"rank": r, "coords": list(mesh.coords(r)), "file": f"device_{r}.onnx"}
            for r in range(mesh.size)
        ],
        "step": sig.to_json(),
        "inputs": {
            v.name: _io_entry(v, layouts[v], kinds.get(v.name, "data"), highs.get(v.name))
            for v in graph.inputs
        },
        "outputs": {v.name: _io_entry(v, layouts[v], None, None) for v in graph.outputs},
        "files": files,
    }


def prepare_outdir(outdir: str) -> str:
    """A fresh temporary sibling of ``outdir``; refuses to clobber foreign directories."""
    outdir = os.path.abspath(outdir)
    parent = os.path.dirname(outdir)
    if not os.path.isdir(parent):
        raise OutputDirError(f"{outdir}: parent directory {parent} does not exist")
    if os.path.exists(outdir):
        if not os.path.isdir(outdir):
            raise OutputDirError(f"{outdir}: exists and is not a directory; choose another -o")
        entries = os.listdir(outdir)
        if entries and "manifest.json" not in entries:
            raise OutputDirError(
                f"{outdir}: exists and is not a tensoropt output directory; choose another -o "
                "or remove it"
            )
    return tempfile.mkdtemp(prefix=".tensoropt-", dir=parent)


def commit_outdir(tmp: str, outdir: str) -> None:
    """Move the finished temporary directory into place (replacing an old output)."""
    outdir = os.path.abspath(outdir)
    old = None
    if os.path.exists(outdir):
        old = tmp + ".old"
        os.replace(outdir, old)
    os.replace(tmp, outdir)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def compile_step(
    step: TrainingStep,
    plan: Plan,
    data_axes: Sequence[int] | None,
    outdir: str,
    estimate: Mapping | None = None,
    options: pipeline.PipelineOptions | None = None,
) -> CompileResult:
    """Partition ``step`` (mutated) by ``plan`` and write ``outdir`` atomically.

    ``data_axes``: mesh axes that shard the batch of data inputs, or None to place data
    inputs by their first consumer's strategy (searched plans). ``estimate``: the cost
    model's estimate of the plan (``cost.model.Estimate.to_json``), kept in the manifest
    so that every command reports the same figures. plan.json records the completed plan:
    every decision unit's strategy, explicit. ``options``: how the passes run
    (verification); None uses ``pipeline.DEFAULT_OPTIONS``.
    """
    model = step.model
    graph = model.graph
    mesh = plan.mesh
    passes = pipeline.front_half(options or pipeline.DEFAULT_OPTIONS)
    to_layouts, to_template = passes.split_after(pipeline.InsertRedistribution.name)
    state = to_layouts(CompileState.of_step(step, plan, data_axes)).state
    ann, annotated, layouts = state.annotation, state.annotated, state.layouts
    completed = completed_plan(plan, ann)
    _sharding_annotations(annotated, ann, {})
    sliced = [n for n, v in graph.initializers.items() if _needs(layouts[v])]
    global_values = _global_values(graph, sliced)
    manifest = _manifest(step, ann, graph, layouts, {})  # global shapes: before localize
    template = to_template(state).state.template
    collectives = sum(1 for n in template.proto.graph.node if n.domain == COLLECTIVE_DOMAIN)
    tmp = prepare_outdir(outdir)
    try:
        files = {}
        onnx.save(annotated, os.path.join(tmp, "annotated.onnx"))
        for rank in range(mesh.size):
            proto = lower_for_rank(template, rank, global_values)
            path = os.path.join(tmp, f"device_{rank}.onnx")
            onnx.save(proto, path)
            files[f"device_{rank}.onnx"] = _sha256(path)
        plan_path = os.path.join(tmp, "plan.json")
        with open(plan_path, "w") as f:
            json.dump(completed.to_json(), f, indent=2)
        files["annotated.onnx"] = _sha256(os.path.join(tmp, "annotated.onnx"))
        files["plan.json"] = _sha256(plan_path)
        manifest["files"] = files
        if estimate is not None:
            manifest["estimate"] = dict(estimate)
        for entry in manifest["ranks"]:
            entry["sha256"] = files[entry["file"]]
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=2)
        commit_outdir(tmp, outdir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return CompileResult(os.path.abspath(outdir), mesh.size, tuple(sorted(files)), collectives)


def completed_plan(plan: Plan, ann: Annotation) -> Plan:
    """``plan`` with every decision unit listed explicitly, as annotate completed it."""
    units = {
        name: UnitStrategy(inputs=tuple(s.inputs), outputs=tuple(s.outputs))
        for name, s in ann.roots.items()
    }
    return dataclasses.replace(plan, units=units, data_axes=None)


def _needs(layout: Layout) -> bool:
    return any(isinstance(p, (Shard, Partial)) for p in layout.placements)
