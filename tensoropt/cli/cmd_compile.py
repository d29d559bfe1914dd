"""``tensoropt compile``: one ONNX training step per device, from a plan."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

from tensoropt.cli.common import (
    TRAINING_HELP,
    Given,
    add_training_options,
    build_step,
    check_output_dir,
    parse_bytes,
    parse_devices,
)
from tensoropt.cli.json_output import add_json_flag
from tensoropt.display import fmt_memory, fmt_step_time
from tensoropt.errors import PlanError, TensorOptError

JSON_SCHEMA = "tensoropt.compile/2"

# --pick policies that take a memory size after a colon.
_BUDGET_POLICIES = ("fastest-under", "fewest-devices-under")

EPILOG = (
    TRAINING_HELP
    + """
plans:
  data-parallel   every mesh axis shards the batch; parameters are replicated
  megatron        Megatron-LM tensor parallelism of attention and MLP blocks (found by
                  structure) on the last mesh axis, data parallelism on the others
  fsdp            fully sharded data parallelism: data-parallel on every mesh axis,
                  ZeRO-3 on every unit that places parameters and every block recomputed
                  (--recompute none keeps the activations; --zero N takes stage N)
  PLAN.json       a plan file (schema tensoropt.plan/1), e.g. one written by compile
  --zero N        with --plan: ZeRO stage N (0-3) on every unit whose parameters are
                  replicated over a mesh axis that splits the batch: 1 optimizer states
                  sharded (gradients reduce-scattered, new parameters all-gathered), 2 also
                  the accumulated gradient, 3 also the parameters (gathered for use); a
                  plan file's per-unit stages are replaced
  --pick POLICY   a point of the searched frontier at --devices (see `tensoropt search`):
                    fastest                   the fastest plan
                    min-memory                the plan with the least memory per device
                    fastest-under:MEM         the fastest plan within MEM per device
                    INDEX                     the point of that index (the "pick" column)
                    fewest-devices-under:MEM  the fastest plan within MEM per device at the
                                              fewest devices; --devices gives the candidate
                                              counts: a list 1,2,4, a range 1-8 (every
                                              count) or 1..8 (powers of two); a single N
                                              means the powers of two below N, and N
  --axes LIST     with --pick (not --search): what that search explores, as `search
                  --axes` (default as search's: the split, and pipeline stages at device
                  counts above one node of --cluster; split,zero,recompute,micro adds the
                  memory axes, all every axis), so a budget the split alone cannot meet
                  can pick a point that trades step time for memory
  without --plan or --pick: --plan data-parallel
  MEM takes a unit: 16GiB, 80GB, 512MiB
  near-ties: a policy ranks points by their estimates alone. When the --cluster profile
                  carries an error band (`tensoropt validate --record`), compile names the
                  other points whose step time is within that band of the picked one's:
                  the estimate cannot order them; pick one by INDEX to compile it instead
  --search FILE   with --pick: a point of that search's JSON (`search --json-out FILE`),
                  not searched again

recompute (activation recomputation, any plan):
  --recompute all|none|REGEX   blocks of the forward (found by structure: residual
                  blocks, transformer half-layers, weight layers; named block_0, block_1,
                  ... in forward order) whose activations are not kept: their forward
                  runs again in the backward. REGEX matches (whole) block names or the
                  names of nodes a block covers; `tensoropt inspect OUTDIR` shows them

pipeline stages (any plan; docs/design/pipeline.md):
  --stages P      cut the model at block starts into P stages of as equal block counts
                  as possible; each stage runs on its own --devices/P devices with the
                  plan's mesh (--mesh shapes one stage's devices), so device g is rank
                  g mod (N/P) of stage g // (N/P). Needs --micro-batches M >= 2: every step
                  runs M micro-batches through the stages, values crossing a cut go as
                  Send/Recv between the stages' devices, and each stage synchronises and
                  updates its own parameters once per step. The estimate is the slowest
                  stage over M + P - 1 micro-batch slots and the largest stage's memory
                  with the micro-batches it holds in flight
  --schedule 1f1b|gpipe  1f1b (default): stage s holds at most P - s micro-batches;
                  gpipe: every forward first, all M held

output (written completely or not at all):
  OUTDIR/device_<k>.onnx  one training step per rank (collectives as ai.tensoropt ops)
  OUTDIR/device_<k>.data  its weights above 1 KiB (ONNX external data; optimizer
                          states are not stored: they start as zeros)
  OUTDIR/plan.json        the plan, reusable with --plan
  OUTDIR/manifest.json    how to slice data and parameters per rank, what carries over
  OUTDIR/annotated.onnx   the unpartitioned step with ONNX IRv11 sharding annotations
                          (+ annotated.data; parameters and states are its inputs)

examples:
  tensoropt compile gpt.onnx --devices 4 --plan data-parallel -o out/
  tensoropt compile gpt.onnx --devices 8 --mesh 2x4 --plan megatron -o out/
  tensoropt compile gpt.onnx --devices 8 --plan megatron --stages 2 --micro-batches 4 -o out/
  tensoropt compile gpt.onnx --devices 2 --pick fastest -o out/
  tensoropt compile gpt.onnx --devices 1-8 --pick fewest-devices-under:1GiB -o out/
  tensoropt search gpt.onnx --devices 1-8 --json-out s.json
  tensoropt compile gpt.onnx --devices 4 --pick min-memory --search s.json -o out/

--json prints, on stdout alone: the output directory and every file written, the mesh,
the plan's source, and the estimate (step time, memory per device as an integer byte
count, collectives per device, cluster); replicates_all_work is true for a plan in which
every device computes the whole step (no collectives: no faster than 1 device).
"""
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "compile",
        help="partition a model's training step into one ONNX graph per device",
        description="Build the training step of MODEL, lay it out on a device mesh by a plan, "
        "insert the collectives the layouts need, and write one graph per device.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL.onnx")
    p.add_argument(
        "--devices",
        metavar="N",
        help="number of devices (ranks); with --pick fewest-devices-under:MEM the candidate "
        "counts (a list or range, see below). With --plan it defaults to what the plan "
        "spans: the --mesh shape's devices times --stages, or a PLAN.json's mesh times "
        "its stages; --pick needs it",
    )
    p.add_argument(
        "--mesh", help="mesh shape, e.g. 8 or 2x4 (dp x tp) (default: 1-D, all N devices)"
    )
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--plan",
        default=None,
        help="data-parallel | megatron | fsdp | PLAN.json (default: data-parallel)",
    )
    how.add_argument(
        "--pick",
        help="fastest | min-memory | fastest-under:MEM | "
        "fewest-devices-under:MEM | INDEX (searches first; see below)",
    )
    p.add_argument(
        "--axes",
        default=None,
        metavar="LIST",
        help="with --pick: what its search explores, as `search --axes` (default as "
        "search's: split, and stages across nodes; split,zero,recompute,micro adds the "
        "memory axes, all every axis)",
    )
    p.add_argument(
        "--zero",
        type=int,
        choices=(0, 1, 2, 3),
        default=None,
        metavar="N",
        help="ZeRO stage 0-3 on every unit with a data-parallel axis (with --plan; see below)",
    )
    p.add_argument("-o", "--output", required=True, metavar="OUTDIR")
    p.add_argument(
        "--micro-batches",
        metavar="K",
        help="run each step's batch as K micro-batches whose gradients are accumulated "
        "(synchronised and applied once per step); overrides a plan file's value",
    )
    p.add_argument(
        "--stages",
        metavar="P",
        help="pipeline: cut the model into P stages at block boundaries (as equal block "
        "counts as possible), each on its own N/P devices (--mesh then shapes one stage's "
        "devices); needs --micro-batches 2 or more",
    )
    p.add_argument(
        "--schedule",
        choices=("1f1b", "gpipe"),
        default=None,
        help="pipeline schedule: 1f1b (each stage alternates forwards and backwards, so "
        "stage s holds at most P - s micro-batches; default) or gpipe (every forward first); "
        "with --stages or a pipelined --plan file (a --pick point keeps its own)",
    )
    add_training_options(p)
    p.add_argument(
        "--cluster",
        default="h100",
        action=Given,
        help="cluster profile that prices the plan (and --pick's search); default h100, or "
        "with --search the file's",
    )
    p.add_argument(
        "--search",
        metavar="SEARCH.json",
        help="take --pick's frontier from a `search --json-out` file instead of searching "
        "again (same model; the training options and --cluster not given are the search's, "
        "and those given must match it)",
    )
    p.add_argument(
        "--recompute",
        metavar="all|none|REGEX",
        help="recompute blocks of the forward in the backward instead of keeping their "
        "activations: all, none, or a regular expression matching block names (block_0, "
        "...) or names of nodes they cover; overrides a plan file's choice",
    )
    add_json_flag(p, JSON_SCHEMA)
    p.add_argument(
        "--verify-passes",
        action="store_true",
        help="check the graph between compile passes (order, shapes, layouts, strategies, "
        "collective groups); slower, for debugging the compiler",
    )
    p.set_defaults(func=run)


def _pipeline_options(args: argparse.Namespace):
    """--verify-passes: verification on, device graphs checked by the runtime's pre-check."""
    from tensoropt.passes.pipeline import PipelineOptions
    from tensoropt.runtime.device_check import check_device_graphs

    if not args.verify_passes:
        return None  # compile_step's default options
    return PipelineOptions(verify=True, device_check=check_device_graphs)


def one_count(text: str | None) -> int:
    """``--devices N`` where one count is meant (every use but fewest-devices-under)."""
    if text is None:
        raise TensorOptError("--pick needs --devices N: the device count to pick a plan for")
    try:
        devices = int(text)
    except ValueError:
        raise TensorOptError(
            f"--devices {text!r}: give one device count, like 4 (a list or range of "
            "candidates only goes with --pick fewest-devices-under:MEM)"
        ) from None
    if devices < 1:
        raise TensorOptError(f"--devices must be at least 1, got {devices}")
    return devices


def candidate_counts(text: str | None) -> list[int]:
    """The device counts ``--pick fewest-devices-under`` chooses from: a list or range as
    for ``search``, or for a single N the powers of two below N, and N."""
    if text is None or text.strip().isdigit():
        top = one_count(text)  # None: refused, --pick needs --devices
        return sorted({1 << k for k in range(top.bit_length()) if 1 << k < top} | {top})
    return parse_devices(text)


def check_policy(policy: str) -> None:
    """Refuse a malformed --pick before the search runs (the search takes a while)."""
    name, colon, arg = policy.partition(":")
    if name in _BUDGET_POLICIES and colon:
        parse_bytes(arg, f"--pick {name}")
    elif not colon and (policy in ("fastest", "min-memory") or policy.isdigit()):
        return
    else:
        raise TensorOptError(
            f"--pick {policy!r}: use fastest, min-memory, fastest-under:MEM, "
            "fewest-devices-under:MEM or a point index"
        )


def parse_mesh(devices: int, text: str | None, plan: str):
    from tensoropt.ir.mesh import Mesh, mesh_dims
    from tensoropt.passes.plans import builtin_axis_names

    if text is None:
        return Mesh((devices,), builtin_axis_names(plan, 1))
    dims = mesh_dims(text)
    size = math.prod(dims)
    if size != devices:
        raise TensorOptError(
            f"--mesh {text} has {size} devices but --devices is {devices}; make them agree"
        )
    return Mesh(dims, builtin_axis_names(plan, len(dims)))


def with_micro_batches(plan, args: argparse.Namespace):
    """``plan`` with ``--micro-batches`` applied (when given)."""
    text = getattr(args, "micro_batches", None)
    if text is None:
        return plan
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise PlanError(f"--micro-batches {text!r}: expected an integer >= 1")
    return dataclasses.replace(plan, micro_batches=k)


def _load_plan_file(path: str, mesh, stages: int | None = None):
    """A plan file, checked against ``--devices`` (``mesh``: one stage's devices when
    ``--stages`` is given): its mesh times its stages must be that many devices."""
    from tensoropt.ir.plan import Plan

    plan = Plan.load(path)
    per_stage = plan.mesh.size
    count = stages if stages is not None else plan.num_stages
    if per_stage * count != mesh.size * (stages or 1):
        times = f" per stage x {count} stages" if count > 1 else ""
        raise PlanError(
            f"{path}: the plan's mesh {plan.mesh} has {per_stage} devices{times} but "
            f"--devices is {mesh.size * (stages or 1)}; compile with --devices "
            f"{per_stage * count}"
        )
    return plan, plan.data_axes


def _compile_picked(args: argparse.Namespace) -> int:
    """Search, pick a point by policy, and compile its plan through the same passes."""
    from tensoropt.cli.cmd_search import explore_from_args
    from tensoropt.cost.accuracy import band_of, near_tie_note
    from tensoropt.search.driver import device_frontier, mesh_label, pick, plan_of_point

    check_policy(args.pick)
    if args.pick.startswith("fewest-devices-under:"):
        counts = candidate_counts(args.devices)
    else:
        counts = [one_count(args.devices)]
    args.epsilon = None
    args.memory_budget = None
    _, _, exp = explore_from_args(args, counts)
    chosen = pick(exp, max(counts), args.pick, parse_bytes)
    search, point = chosen.search, chosen.point
    band, tie = band_of(args.cluster), None
    if band is not None:  # the frontier is merged again only for the note
        rows = device_frontier(exp, search.devices)
        tie = near_tie_note(
            [p.time_s for _, p in rows],
            [p.memory_bytes for _, p in rows],
            chosen.index,
            band,
            search.devices,
        )
    source = f"search --pick {args.pick}: point {chosen.index} at {search.devices} devices"
    plan = plan_of_point(search, point, source)
    picked = (
        f"picked {args.pick}: point {chosen.index} at {search.devices} devices, mesh "
        f"{mesh_label(search.mesh.shape, search.variant.stages)}; "
        f"{search.summaries[search.result.points.index(point)]}"
    )
    summary, notes, estimate, result = _compile_searched(args, plan)
    print(picked, file=sys.stderr)
    if tie:
        print(tie, file=sys.stderr)
    for line in (summary, *notes):
        print(line, file=sys.stderr)
    _report(args, result, search.mesh, (source, *notes), estimate, source, plan)
    return 0


def _compile_searched(args: argparse.Namespace, plan):
    """Compile a searched point's plan (with ``--recompute`` applied): the trained-set
    summary, the notes on what the flags changed, the estimate and the compile result."""
    step = build_step(args, load_weights=False)  # compile streams the weights itself
    summary = step.selection.summary(step.model.graph)  # the whole model: before compile
    plan, notes = with_recompute(args, step, plan)
    estimate = estimate_of(step, plan, None, args.cluster)
    result = compile_written(args, step, plan, None, estimate)
    return summary, notes, estimate, result


def compile_written(args: argparse.Namespace, step, plan, data_axes, estimate):
    """``compile_step`` into ``args.output``, its progress on stderr: one item per model
    file written (a bar on a terminal; otherwise a line every 10 s once it takes that
    long: a 2.7 B-parameter model on 16 devices takes about half a minute)."""
    from tensoropt.cli.progress import Progress
    from tensoropt.passes.compile import compile_step, files_written

    progress = Progress(files_written(plan), desc="compile", announce=False)
    progress.describe("partitioning the step")
    try:
        return compile_step(
            step, plan, data_axes, args.output, estimate.to_json(), _pipeline_options(args),
            tick=progress.tick,
        )  # fmt: skip
    finally:
        progress.close()


def _compile_from_search(args: argparse.Namespace) -> int:
    """``--pick POLICY --search FILE``: expand a point of a search JSON and compile it,
    without searching again (the file holds the strategies of every point)."""
    from tensoropt.cli.search_json import (
        check_matches,
        inherit,
        load_search,
        pick_row,
        plan_of,
        step_options,
    )
    from tensoropt.cost.accuracy import band_of, near_tie_note
    from tensoropt.cost.cluster import load_cluster
    from tensoropt.search.driver import mesh_label
    from tensoropt.search.merge import fewer_note

    check_policy(args.pick)
    if args.mesh is not None:
        raise TensorOptError(
            f"--mesh {args.mesh} with --search: the file's frontier is over every mesh it "
            f"searched; search with --mesh {args.mesh} --json-out FILE and compile from that"
        )
    if args.pick.startswith("fewest-devices-under:"):
        devices = max(candidate_counts(args.devices))
    else:
        devices = one_count(args.devices)
    sf = load_search(args.search)
    inherited = inherit(sf, args)
    check_matches(sf, step_options(args), load_cluster(args.cluster).to_json())
    if inherited:
        print(f"--search {args.search}: compiling with its {', '.join(inherited)}", file=sys.stderr)
    chosen = pick_row(sf, devices, args.pick, parse_bytes)
    rows = sf.rows(chosen.devices)
    tie = near_tie_note(
        [r["time_s"] for r in rows],
        [r["memory_bytes"] for r in rows],
        chosen.index,
        band_of(args.cluster),
        chosen.devices,
    )
    source = (
        f"search --pick {args.pick} ({args.search}): point {chosen.index} at "
        f"{chosen.devices} devices"
    )
    plan = plan_of(sf, chosen, source)
    summary, notes, estimate, result = _compile_searched(args, plan)
    print(
        f"picked {args.pick} from {args.search}: point {chosen.index} at {chosen.devices} "
        f"devices, mesh {mesh_label(plan.mesh.shape, plan.num_stages)}; "
        f"{chosen.row.get('summary', '')}",
        file=sys.stderr,
    )
    if tie:
        print(tie, file=sys.stderr)
    fewer = chosen.row.get("no_better_than_devices")  # absent from older search files
    if fewer_note(fewer, chosen.row.get("summary", "")):  # the tables' rule
        count = f"{fewer} device{'s' if fewer > 1 else ''}"
        print(
            f"note: no better than {count}: a plan of {args.search} on {count} is as fast "
            "with no more memory per device",
            file=sys.stderr,
        )
    for line in (summary, *notes):
        print(line, file=sys.stderr)
    _report(args, result, plan.mesh, (source, *notes), estimate, source, plan)
    return 0


def _with_zero(stage: int, step, plan, data_axes, notes):
    """``--zero N``: the plan with stage N on every unit that has a ZeRO axis."""
    from tensoropt.ir.plan import ZeroStage
    from tensoropt.passes.plans import check_plan, with_zero

    check_plan(step.model.graph, plan)  # a plan file's errors first, naming its units
    graph, sig = step.model.graph, step.signature
    zeroed = with_zero(plan, graph, sig, data_axes, ZeroStage(stage), f"--zero {stage}")
    return zeroed.plan, (*notes, *zeroed.notes)


def stage_count(args: argparse.Namespace) -> int:
    """``--stages P`` (1 without the flag)."""
    text = getattr(args, "stages", None)
    if text is None:
        return 1
    try:
        count = int(str(text))
    except ValueError:
        count = 0
    if count < 1:
        raise PlanError(f"--stages {text!r}: expected an integer >= 1")
    return count


def _spanned(args: argparse.Namespace, plan_name: str, is_file: bool) -> int:
    """The devices a plan spans without ``--devices``: the ``--mesh`` shape's, or a plan
    file's mesh's, times its stages (``--stages``, else the file's own)."""
    from tensoropt.ir.mesh import mesh_dims

    if args.mesh is not None:
        return math.prod(mesh_dims(args.mesh)) * stage_count(args)
    if is_file:
        from tensoropt.ir.plan import Plan

        plan = Plan.load(plan_name)
        stages = stage_count(args) if args.stages is not None else plan.num_stages
        return plan.mesh.size * stages
    raise TensorOptError(
        f"--plan {plan_name}: give --devices N, or --mesh like 2x4 (the plan spans its devices)"
    )


def stage_devices(args: argparse.Namespace, devices: int) -> int:
    """Devices per stage: ``--devices`` over ``--stages``, refused unless it divides."""
    count = stage_count(args)
    if devices % count:
        raise PlanError(
            f"--stages {count}: {devices} devices do not split into {count} equal stages; "
            f"give --devices a multiple of {count}"
        )
    return devices // count


def with_stages(args: argparse.Namespace, step, plan):
    """``plan`` cut into ``--stages`` pipeline stages and run under ``--schedule``
    (unchanged without the flags, except a plan file's schedule that --schedule sets)."""
    import dataclasses

    count = stage_count(args)
    given = getattr(args, "schedule", None)
    schedule = given or plan.schedule
    if count == 1:
        if getattr(args, "stages", None) is not None:
            plan = dataclasses.replace(plan, stages=())
        if given is not None and not plan.stages:  # a schedule of nothing: refused
            raise TensorOptError(
                f"--schedule {given}: the plan has no pipeline stages to schedule; give "
                "--stages P (2 or more) and --micro-batches M with it"
            )
        return dataclasses.replace(plan, schedule=schedule)
    from tensoropt.passes.recompute import find_blocks
    from tensoropt.passes.stages import even_starts

    blocks = find_blocks(step.model.graph, step.signature.data_inputs)
    return dataclasses.replace(plan, stages=even_starts(blocks, count), schedule=schedule)


def with_recompute(args: argparse.Namespace, step, plan) -> tuple[object, tuple[str, ...]]:
    """``plan`` with the blocks ``--recompute`` chooses, and a note that says how many
    (unchanged and no note without the flag)."""
    if args.recompute is None:
        return plan, ()
    import dataclasses

    from tensoropt.passes.recompute import find_blocks, select_blocks

    blocks = find_blocks(step.model.graph, step.signature.data_inputs)
    chosen = select_blocks(blocks, args.recompute)
    note = f"--recompute {args.recompute}: {len(chosen)} of {len(blocks)} blocks recomputed"
    return dataclasses.replace(plan, recompute=chosen), (note,)


def _priced(step, plan, data_axes, cluster):
    """What pricing ``plan`` reads: the search graph, the root strategies (on the micro
    mesh when micro-batched), the ZeRO stages and the profile. The plan's recomputed
    blocks are cloned into the step first, as compile does."""
    from tensoropt.cost.cluster import load_cluster
    from tensoropt.cost.model import search_graph_of
    from tensoropt.passes.annotate import complete_plan, plan_zero
    from tensoropt.passes.plans import check_plan
    from tensoropt.passes.recompute import apply_recompute

    check_plan(step.model.graph, plan)  # names the unit, tensor, dim and sizes
    apply_recompute(step.model, step.signature.data_inputs, plan.recompute)
    sg = search_graph_of(step)
    if plan.micro_batches > 1:
        from tensoropt.passes.micro import micro_roots

        roots, _ = micro_roots(sg.graph, sg.signature, plan, data_axes)
    else:
        roots = complete_plan(sg.graph, sg.signature, plan, data_axes, sg.units)
    zero = plan_zero(plan, sg.units)
    profile = load_cluster(cluster) if isinstance(cluster, str) else cluster
    return sg, roots, zero, profile


def pipeline_terms_of(step, plan, data_axes, cluster):
    """The plan's :class:`~tensoropt.cost.pipeline.PipelineTerms` (its intra-op plan, any
    cut) and the step's segments."""
    from tensoropt.cost.pipeline import plan_terms
    from tensoropt.passes.stages import step_segments

    sg, roots, zero, profile = _priced(step, plan, data_axes, cluster)
    segments = step_segments(step.model.graph, step.signature.data_inputs)
    terms = plan_terms(
        sg, roots, plan.mesh, profile, micro_batches=plan.micro_batches,
        segment_of=[segments.segment_of(u.root.name) for u in sg.units.units],
        segments=segments.count, zero=zero,
    )  # fmt: skip
    return terms, segments


def estimate_of(step, plan, data_axes, cluster):
    """The cost model's estimate of ``plan`` on ``step`` (before compile partitions it):
    the same pricing as the search's, so a picked point's figures come back unchanged.
    A pipelined plan is priced by its stages (``cost.pipeline``). ``cluster``: a
    profile name or file, or a ClusterProfile."""
    from tensoropt.cost.model import estimate_plan

    if plan.stages:
        from tensoropt.passes.stages import require_micro_batches

        require_micro_batches(plan)  # before pricing, which assumes a micro mesh
        terms, segments = pipeline_terms_of(step, plan, data_axes, cluster)
        return terms.price(segments.cuts(plan.stages), plan.schedule)[0]
    sg, roots, zero, profile = _priced(step, plan, data_axes, cluster)
    return estimate_plan(sg, roots, plan.mesh, profile, micro_batches=plan.micro_batches, zero=zero)


REPLICATED_NOTE = "every device computes the whole step: no faster than 1 device"


def replicates_all_work(result) -> bool:
    """A plan on several devices that needs no collective splits no work: each device
    runs the single-device step (any split work needs at least the gradient reduction),
    unless pipeline stages share the step out."""
    return result.world_size > 1 and result.collectives == 0 and result.stages == 1


def _pipeline_json(plan) -> dict | None:
    """The JSON ``pipeline`` of a compile: stages, their start blocks and the schedule."""
    if plan is None or not plan.stages:
        return None
    return {
        "stages": plan.num_stages,
        "starts": list(plan.stages),
        "schedule": plan.schedule,
        "micro_batches": plan.micro_batches,
        "devices_per_stage": plan.mesh.size,
    }


def _report(args, result, mesh, notes, estimate, source: str, plan=None) -> None:
    from tensoropt.cost.accuracy import band_of

    band = band_of(args.cluster)
    if args.json:
        from tensoropt.cli.json_output import document, emit

        files = list(result.files)
        if "manifest.json" not in files:
            files.append("manifest.json")
        body = {
            "outdir": result.outdir,
            "files": [os.path.join(result.outdir, name) for name in sorted(files)],
            "world_size": result.world_size,
            "mesh": list(mesh.shape),
            "plan_source": source,
            "collectives_per_device": result.collectives,
            "replicates_all_work": replicates_all_work(result),
            "estimate": estimate.to_json(),
            "pipeline": _pipeline_json(plan),
            "error_band": band.to_json() if band is not None else None,
            "notes": list(notes),
        }
        emit(args, document(JSON_SCHEMA, body))
        return
    replicated = f" ({REPLICATED_NOTE})" if replicates_all_work(result) else ""
    if band is not None and band.time(mesh.size) is not None:
        print(f"estimate: {band.describe(mesh.size)}", file=sys.stderr)
    link = band.link_note(result.world_size) if band is not None else None
    if link is not None:
        print(f"memory link: {link}", file=sys.stderr)
    where = f"on mesh {mesh}"
    if plan is not None and plan.stages:
        where = (
            f"in {plan.num_stages} pipeline stages of mesh {mesh} ({plan.micro_batches} "
            f"micro-batches, {plan.schedule})"
        )
    print(
        f"wrote {result.outdir}: {result.world_size} device graphs {where}, "
        f"{result.collectives} collectives per device{replicated}; estimated step "
        f"{fmt_step_time(estimate.time_s)}, {fmt_memory(estimate.memory_bytes)} per "
        f"device ({estimate.profile}); run it with "
        f"`tensoropt run {args.output} --steps 3 --verify`"
    )


def run(args: argparse.Namespace) -> int:
    from tensoropt.cost.cluster import load_cluster
    from tensoropt.passes.plans import builtin_plan

    check_output_dir(args.output, "-o")
    load_cluster(args.cluster)  # a malformed profile is refused before any work
    if args.search and not args.pick:
        raise TensorOptError("--search FILE: give --pick POLICY to choose one of its points")
    if args.pick and args.zero is not None:
        raise TensorOptError(
            f"--zero {args.zero} applies to --plan (data-parallel, megatron, fsdp or a "
            "PLAN.json); a --pick point carries its own choices: drop --zero"
        )
    if args.axes is not None and (not args.pick or args.search):
        where = (
            "--search FILE already holds its search's points: give --axes to that search"
            if args.search
            else "give --pick (a --plan takes --zero, --recompute, --micro-batches, --stages)"
        )
        raise TensorOptError(f"--axes {args.axes} chooses what --pick searches; {where}")
    if args.pick and args.micro_batches is not None:
        raise TensorOptError(
            f"--micro-batches {args.micro_batches} applies to --plan; a --pick point carries "
            "its own micro-batches (--axes ...,micro searches 1, 2, 4 and 8): drop "
            "--micro-batches, or compile the picked plan.json with --plan and --micro-batches"
        )
    if args.pick:
        for flag, given in (("--stages", args.stages), ("--schedule", args.schedule)):
            if given is not None:
                raise TensorOptError(
                    f"{flag} {given} applies to --plan; a --pick point carries its own "
                    f"stages and schedule (search --axes ...,stages prices 1f1b): drop "
                    f"{flag}, or compile the picked plan.json with --plan and {flag}"
                )
    if args.pick and args.search:
        return _compile_from_search(args)
    if args.pick:
        return _compile_picked(args)
    plan_name = args.plan or "data-parallel"
    is_file = plan_name.endswith(".json") or os.path.sep in plan_name
    devices = (
        one_count(args.devices) if args.devices is not None else _spanned(args, plan_name, is_file)
    )
    if not is_file and plan_name not in ("data-parallel", "megatron", "fsdp"):
        raise PlanError(
            f"--plan {plan_name!r}: use data-parallel, megatron, fsdp or a PLAN.json file"
        )
    if is_file:
        mesh = parse_mesh(stage_devices(args, devices), args.mesh, "data-parallel")
        flag = stage_count(args) if args.stages is not None else None
        plan, data_axes = _load_plan_file(plan_name, mesh, flag)
        if args.mesh is not None and tuple(plan.mesh.shape) != tuple(mesh.shape):
            # a plan file's layouts are written for its own mesh: another shape of the
            # same devices would be a different plan, so it is refused, not applied
            raise PlanError(
                f"--mesh {args.mesh}: {plan_name} is a plan for mesh "
                f"{'x'.join(map(str, plan.mesh.shape))}, whose layouts name its axes; drop "
                "--mesh (a plan file carries its mesh) or compile a plan for that mesh"
            )
        mesh = plan.mesh
        notes = ()
    else:
        mesh = parse_mesh(stage_devices(args, devices), args.mesh, plan_name)
    # compile streams the weights itself; a built-in plan may rewrite the forward first,
    # and a plan file written for megatron names the nodes of that rewrite
    prepared = plan_name
    if is_file:
        prepared = "megatron" if plan.source == "megatron" else None
    step = build_step(args, load_weights=False, plan=prepared)
    summary = step.selection.summary(step.model.graph)
    if not is_file:
        built = builtin_plan(plan_name, step.model.graph, step.signature, mesh)
        plan, data_axes, notes = built.plan, built.data_axes, built.notes
    plan = with_micro_batches(plan, args)
    if args.zero is not None:
        plan, notes = _with_zero(args.zero, step, plan, data_axes, notes)
    plan, recomputed = with_recompute(args, step, plan)
    notes = (*notes, *recomputed)
    plan = with_stages(args, step, plan)
    # Everything that can fail runs before anything is printed: an error stays one line.
    estimate = estimate_of(step, plan, data_axes, args.cluster)
    result = compile_written(args, step, plan, data_axes, estimate)
    if args.plan is None:
        print("no --plan or --pick given: compiled --plan data-parallel", file=sys.stderr)
    for line in (summary, *notes):
        print(line, file=sys.stderr)
    _report(args, result, mesh, notes, estimate, plan.source or plan_name, plan)
    return 0
