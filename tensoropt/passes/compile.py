"""The compile pipeline: training step + plan -> an output directory.

``annotate -> annotated.onnx (IRv11 sharding specs) -> insert_redistribution ->
localize -> lower_for_rank (per rank) -> device_<k>.onnx + device_<k>.data +
plan.json + manifest.json``. Weights are never held in memory: they are detached
before the first serialization and streamed, block by block, into each file's
external data (``ir/external.py``; the format is in docs/design/scale.md). The
directory is written completely or not at all: everything goes to a temporary
sibling directory that is renamed into place at the end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import onnx
import onnx_ir as ir

from tensoropt.errors import OutputDirError
from tensoropt.ir.builder import static_shape
from tensoropt.ir.external import (
    INLINE_MAX_BYTES,
    Block,
    DataFileWriter,
    DigestCache,
    TensorSource,
    block_nbytes,
    read_block,
    set_external,
    set_inline,
    source_of,
)
from tensoropt.ir.files import mkdtemp_public
from tensoropt.ir.layout import Layout, Partial, Shard
from tensoropt.ir.mesh import Mesh
from tensoropt.ir.plan import Plan, UnitStrategy, ZeroStage
from tensoropt.passes import micro, pipeline, stages
from tensoropt.passes.annotate import Annotation
from tensoropt.passes.device_stats import collectives_per_step
from tensoropt.passes.infra import CompileState
from tensoropt.passes.partition import lower_for_rank
from tensoropt.passes.recompute import find_blocks
from tensoropt.passes.training_step import TrainingStep

log = logging.getLogger(__name__)

MANIFEST_SCHEMA = "tensoropt.manifest/1"


@dataclass(frozen=True, slots=True)
class CompileResult:
    outdir: str
    world_size: int
    files: tuple[str, ...]
    collectives: int  # issued per step by the busiest device (device_stats.collectives_per_step)
    stages: int = 1  # pipeline stages: each runs its part of the step


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
    states = set(sig.states)
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
            | ({"init": "zeros"} if v.name in states else {})
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
    return mkdtemp_public(parent, prefix=".tensoropt-")


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
    tick: Callable[[str], None] | None = None,
) -> CompileResult:
    """Partition ``step`` (mutated) by ``plan`` and write ``outdir`` atomically.

    ``data_axes``: mesh axes that shard the batch of data inputs, or None to place data
    inputs by their first consumer's strategy (searched plans). ``estimate``: the cost
    model's estimate of the plan (``cost.model.Estimate.to_json``), kept in the manifest
    so that every command reports the same figures. plan.json records the completed plan:
    every decision unit's strategy, explicit. ``options``: how the passes run
    (verification); None uses ``pipeline.DEFAULT_OPTIONS``. ``tick(label)`` is called
    as each of the :func:`files_written` model files is written (a progress display).

    No weight is held in memory: the initializers are swapped for data-free stand-ins
    first (:func:`detach_weights`), and each file's external data is copied from the
    sources block by block as the file is written.
    """
    model = step.model
    graph = model.graph
    mesh = plan.mesh
    sig = step.signature
    sources = detach_weights(graph)
    blocks = find_blocks(graph, sig.data_inputs) if plan.stages else ()
    passes = pipeline.front_half(options or pipeline.DEFAULT_OPTIONS)
    to_layouts, to_template = passes.split_after(pipeline.InsertRedistribution.name)
    state = to_layouts(CompileState.of_step(step, plan, data_axes)).state
    ann, annotated, layouts = state.annotation, state.annotated, state.layouts
    if plan.micro_batches > 1:  # the files describe the plan's mesh, not the micro mesh
        ann = micro.plan_mesh_view(ann, mesh)
        layouts = {v: Layout(lay.placements[1:]) for v, lay in state.layouts.items()}
    completed = completed_plan(plan, ann)
    _sharding_annotations(annotated, ann, {})
    manifest = _manifest(step, ann, graph, layouts, {})  # global shapes: before localize
    if plan.micro_batches > 1:
        micro_layouts = {v: state.layouts[v] for v in graph.inputs}
    template = to_template(state).state.template
    if plan.micro_batches > 1:
        cut = micro.cut_of(template.proto)
        micro.manifest_micro(manifest, graph, micro_layouts, cut)
    # Optimizer states start as zeros that the runtime makes (manifest "init": "zeros");
    # the reference step gets parameters and states fed, so it stores neither.
    _drop_initializers(template.proto.graph, set(sig.states))
    _drop_initializers(annotated.graph, {*sig.params, *sig.states})
    k = plan.micro_batches
    collectives = collectives_per_step(template.proto.graph, k)
    devices = [(template, _lowered(rank)) for rank in range(mesh.size)]
    if plan.stages:
        staged = stages.cut_stages(template, plan, blocks, set(sig.params), set(sig.states))
        devices = [
            (staged[s], _lowered_stage(s, r, mesh.size))
            for s in range(plan.num_stages)
            for r in range(mesh.size)
        ]
        _manifest_stages(manifest, plan, staged)
        collectives = max(collectives_per_step(t.proto.graph, k) for t in staged)
    tmp = prepare_outdir(outdir)
    try:
        digests = DigestCache()
        tick = tick or (lambda _label: None)
        files = _write_model(annotated, tmp, "annotated", sources, _full_blocks, digests)
        tick("annotated.onnx written")
        for rank, entry in enumerate(manifest["ranks"]):
            device_template, fill = devices[rank]
            written = _write_model(device_template, tmp, f"device_{rank}", sources, fill, digests)
            tick(f"device_{rank}.onnx written")
            files.update(written)
            data = f"device_{rank}.data"
            entry["data"] = data if data in written else None
        plan_path = os.path.join(tmp, "plan.json")
        with open(plan_path, "w") as f:
            json.dump(completed.to_json(), f, indent=2)
        files["plan.json"] = _sha256(plan_path)
        manifest["files"] = dict(sorted(files.items()))
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
    return CompileResult(
        os.path.abspath(outdir), plan.world_size, tuple(sorted(files)), collectives,
        plan.num_stages,
    )  # fmt: skip


def files_written(plan: Plan) -> int:
    """The model files :func:`compile_step` writes for ``plan``: the annotated step and
    one per device."""
    return 1 + plan.world_size


def _manifest_stages(manifest: dict, plan: Plan, staged) -> None:
    """Pipelined plans: one device per (stage, sub-mesh rank), each with the inputs its
    stage's graph reads, and the schedule (``manifest["pipeline"]``)."""
    n = plan.mesh.size
    ranks = []
    for s, template in enumerate(staged):
        inputs = [i.name for i in template.proto.graph.input]
        outputs = [o.name for o in template.proto.graph.output]
        for r in range(n):
            ranks.append(
                {
                    "rank": s * n + r,
                    "coords": list(plan.mesh.coords(r)),
                    "file": f"device_{s * n + r}.onnx",
                    "stage": s,
                    "inputs": inputs,
                    "outputs": outputs,
                }
            )
    manifest["ranks"] = ranks
    manifest["world_size"] = plan.world_size
    info = stages.StageInfo(
        0, plan.num_stages, plan.schedule, plan.micro_batches, n, plan.stages
    ).to_json()
    del info["stage"]
    manifest["pipeline"] = info


def completed_plan(plan: Plan, ann: Annotation) -> Plan:
    """``plan`` with every decision unit listed explicitly, as annotate completed it."""
    units = {
        name: UnitStrategy(
            inputs=tuple(s.inputs),
            outputs=tuple(s.outputs),
            zero=ann.zero.get(name, ZeroStage.NONE),
        )
        for name, s in ann.roots.items()
    }
    return dataclasses.replace(plan, units=units, data_axes=None)


STAND_IN_LOCATION = "__tensoropt_detached__"
"""The location of a stand-in initializer: never written to a file (see detach_weights)."""


def detach_weights(graph: ir.Graph) -> dict[str, TensorSource]:
    """Swap initializers for data-free stand-ins; return where their bytes are.

    Every external-data initializer and every in-memory one above
    :data:`INLINE_MAX_BYTES` is detached, so that serializing the graph (the
    annotated step, the local template) copies no weight bytes; the passes after
    this read only shapes and small integer constants. External data files are
    checked here (present, long enough), before any work is done.
    """
    sources: dict[str, TensorSource] = {}
    for name, value in graph.initializers.items():
        tensor = value.const_value
        if tensor is None or tensor.dtype == ir.DataType.STRING:
            continue
        if not isinstance(tensor, ir.ExternalTensor) and tensor.nbytes <= INLINE_MAX_BYTES:
            continue
        sources[name] = source_of(tensor)
        value.const_value = ir.ExternalTensor(
            STAND_IN_LOCATION, 0, tensor.nbytes, tensor.dtype, shape=tensor.shape, name=name
        )
    return sources


def _drop_initializers(graph: onnx.GraphProto, names: set[str]) -> None:
    kept = [t for t in graph.initializer if t.name not in names]
    del graph.initializer[:]
    graph.initializer.extend(kept)


@dataclass(frozen=True, slots=True)
class _StreamedWeights:
    """A :class:`WeightSink` that writes blocks into one data file (inline when small)."""

    sources: Mapping[str, TensorSource]
    writer: DataFileWriter

    def place(self, tensor: onnx.TensorProto, block: Block, zeros: bool) -> None:
        source = self.sources.get(tensor.name)
        if source is None:
            raise AssertionError(f"initializer {tensor.name!r} is a stand-in without a source")
        del tensor.dims[:]
        tensor.dims.extend(s.stop - s.start for s in block)
        if block_nbytes(block, source.dtype) <= INLINE_MAX_BYTES:
            set_inline(tensor, read_block(source, block, zeros))
        else:
            offset, length = self.writer.append(source, block, zeros)
            set_external(tensor, self.writer.location, offset, length)


def _lowered(rank: int):
    """The ``fill`` of :func:`_write_model` for ``rank``'s device graph."""
    return lambda template, weights: lower_for_rank(template, rank, weights)


def _lowered_stage(stage: int, rank: int, ranks_per_stage: int):
    """The ``fill`` of :func:`_write_model` for rank ``rank`` of pipeline stage ``stage``."""
    return lambda template, weights: stages.globalize(
        lower_for_rank(template, rank, weights), stage, rank, ranks_per_stage
    )


def _full_blocks(proto: onnx.ModelProto, weights: _StreamedWeights) -> onnx.ModelProto:
    """Every stand-in initializer of ``proto`` gets its whole value."""
    for init in proto.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            weights.place(init, tuple(slice(0, d) for d in init.dims), False)
    return proto


def _write_model(
    model, tmp: str, stem: str, sources: Mapping[str, TensorSource], fill, digests: DigestCache
) -> dict[str, str]:
    """Write ``<stem>.onnx`` and its data file ``<stem>.data``; their sha256 by file name.

    ``fill(model, weights)`` returns the ModelProto to write, its stand-ins placed.
    """
    writer = DataFileWriter(os.path.join(tmp, f"{stem}.data"), digests)
    try:
        proto = fill(model, _StreamedWeights(sources, writer))
        data_digest = writer.close()
    except BaseException:
        writer.abort()
        raise
    path = os.path.join(tmp, f"{stem}.onnx")
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())
    files = {f"{stem}.onnx": _sha256(path)}
    if data_digest is not None:
        files[f"{stem}.data"] = data_digest
    return files


def _needs(layout: Layout) -> bool:
    return any(isinstance(p, (Shard, Partial)) for p in layout.placements)
