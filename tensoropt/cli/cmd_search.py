"""``tensoropt search``: the Pareto frontier of (step time, memory per device, devices)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Collection, Sequence

from tensoropt.cli.common import (
    DEVICES_HELP,
    add_model_input_options,
    check_output_file,
    parse_bytes,
    parse_devices,
    search_graph,
    write_atomic,
)
from tensoropt.cli.json_output import add_json_flag, add_json_out
from tensoropt.cli.search_json import SCHEMA
from tensoropt.display import fmt_memory, fmt_step_time
from tensoropt.search.memory import SHARE as SEARCH_SHARE

EPILOG = """\
what it does: builds the cost problem of the model on every mesh of every device
count (1-D, and with --mesh auto every 2-D factorisation dp x tp), solves each with
Frontier Tracking (exact Pareto frontier of estimated step time vs memory per
device), and merges them into one frontier over (devices, time, memory).
The weights are not loaded: planning needs only shapes. How many devices a plan needs:
a row of an N-device table that a plan on fewer devices matches (as fast, no more
memory per device) ends "(no better than M devices)" (JSON: "no_better_than_devices");
the overall frontier leaves such points out. A reference plan (data-parallel, megatron,
and with the memory axes fsdp and megatron+recompute) that no mesh of a count can
express says why under the reference table (JSON: "references_missing").

exact or epsilon: every frontier is exact by default. --epsilon E guarantees instead
that for every plan on N devices some point of the N-device frontier is at most (1+E)
times as slow with no more memory (memory is never approximated: budgets and the
least-memory point stay exact; repeated blocks are composed exactly, each run of them
is thinned once with half the slack, and the other half is spread over the steps around
them). For large models on many devices, whose exact frontiers reach tens of thousands of
points 0.01% apart: the GPT-3 175B shape (Adam, h100) on 64, 256 and 1024 devices with
--epsilon 0.05 takes 49-56 s on a 2-core Intel Xeon host (10 s more on the first run
after an install, which compiles the search's kernels), with the default stages and
micro-batch counts (every stage count to 64, and 2, 4 and 8 micro-batches: each
count's stage meshes are searched, their problems and cuts pruned by bounds on every
cut against the points already made), and 17-20 s with --stages 1; exact took 950 s
of CPU without stages when the same epsilon search took 110 s (benchmarks/RESULTS.md,
"Pipeline stages"). On such a model, name the stage and micro-batch counts you would
deploy.

memory axes (--axes split,zero,recompute,micro; split alone by default, as every
axis multiplies the search time): besides the split of every op, each mesh is
searched with ZeRO stage 1, 2 or 3 on every unit that can shard its parameters over
its data-parallel devices, with every block recomputed in the backward (only the
block inputs kept), and with the batch run as K micro-batches (--micro-batches,
default 1,2,4,8: those that divide the batch) whose gradients accumulate. Each
combination is one more problem of the mesh; their frontiers merge exactly, and a
point's plan says what it uses ("dp=8 ..., zero-3, recompute 24/24 blocks, 4
micro-batches"). --axes split,zero (say) shows what an axis buys. Recomputed
blocks add the working set of the largest block's recompute, which is not a sum
of unit entries: the search prices an upper bound that is (the least working set
of each block plus every unit's excess over its least), so --dump-costs stays an
exact sum; compile prices the same bound.

pipeline stages (by default at the device counts above one node of the cluster, where
tensor parallelism meets the slow links; --axes ...,stages at every count, with the
micro-batched points shown too; --stages 1 turns them off): every micro-batched problem
of a mesh M also gives pipelined points at P x M.size devices for each --stages count
P: for each plan on that problem's whole frontier (solved without the budget and
without the plans of other problems, which may beat a plan whose stages still win), the
exact Pareto set of (step time, memory) over its cuts into P stages at block starts
(every block start up to 64 blocks, else 65 evenly spread positions), each stage on its
own copy of M; 1F1B, the step priced as the slowest stage over m + P - 1 micro-batch
slots. They show as mesh ppP:M ("pp=4 x (...)"), compile with --pick like any point,
and the reference megatron+pp is Megatron within each stage at its fastest cut. Device
counts N/P are searched for them and not shown. What is left out: a stage's plan is a
plan of the whole micro-batched frontier (not one searched per stage), and every stage
has the same mesh.

estimates: compute is a roofline per local shard (forward + backward); communication
is alpha-beta per mesh axis with intra- and inter-node rates; memory per device is
parameter, gradient and optimizer-state shards, activations saved for backward and
redistribution buffers. --cluster picks the rates: v100, a100, h100, h200 or a JSON
file (keys of the built-in profiles; "base": NAME to override only some rates).

error band: with a profile file from `tensoropt calibrate`, each table says how far its
step times are typically off: the median |error| of the plans `tensoropt validate
--record` measured with that profile (one device and several apart), else the
calibration's measurement spread (a lower bound, labelled so); a built-in profile has
none. A row marked ~ is within that band of the row above: the estimate cannot order
the two (JSON: "error_band", and "near_tie_with_previous" per point). With several
devices, a line under the tables says which memory-link case the estimates assume (a
link per rank) and what the profile measured of the host's link.

examples:
  tensoropt search gpt.onnx --devices 1,2,4,8 --plot frontier.png
  tensoropt search gpt.onnx --devices 1..64 --cluster v100 --memory-budget 16GiB
  tensoropt search bert-large.onnx --devices 8 --mesh 2x4 --json-out s.json --dump-costs costs.json
  tensoropt search gpt.onnx --devices 2 --json | jq '.per_device["2"][0]'
  tensoropt search gpt.onnx --devices 1..64 --epsilon 0.05     # faster, within 5% in time
  tensoropt search gpt.onnx --devices 1,2,4,8 --axes split,zero,recompute,micro
  tensoropt search gpt.onnx --devices 8 --axes split,zero       # what ZeRO alone buys

JSON (--json on stdout, --json-out FILE): every frontier point per device count with
its estimate and summary; its plan is a vector of indices into a per-mesh table of
strategies (`compile --search FILE --pick POLICY` expands it), the merged frontier and
the reference plans.
"""


def add_search_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cluster", default="h100", help="v100 | a100 | h100 | h200 | FILE.json (default h100)"
    )
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--loss", choices=["auto", "ce", "mse"], default="auto")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="drop plans over SIZE per device; SIZE takes a unit: 16GiB, 80GB, 512MiB",
    )
    p.add_argument("--epsilon", type=float, help="approximate within (1+E) in step time")
    p.add_argument("--trainable", metavar="REGEX")
    p.add_argument("--freeze", metavar="REGEX")
    p.add_argument(
        "--axes",
        default=None,
        metavar="LIST",
        help="what the search explores: split (how each op is split over the mesh; always), "
        "zero (ZeRO stage 1, 2 or 3 of every unit that can shard its parameters), "
        "recompute (every block recomputed in the backward), micro (micro-batches with "
        "gradient accumulation), stages (pipeline stages over the micro-batched plans; "
        "implies micro); all: every one of them. Default: split, and stages at the device "
        "counts above one node of --cluster (devices_per_node: 8 on the built-in ones), "
        "whose micro-batches run only within the pipelines. split,zero,recompute,micro "
        "takes 7-8x the search time of split alone on GPT-2-medium, 1..64 devices",
    )
    p.add_argument(
        "--stages",
        dest="stage_counts",
        default=None,
        metavar="LIST",
        help="pipeline stage counts tried (default 2,4,8,16,32,64; a count P is tried at N "
        "devices when P divides N and the model has P blocks, by default only where N "
        "spans more than one node; a count given here that fits no such device count or "
        "exceeds the blocks is refused); 1: no stages",
    )
    p.add_argument(
        "--micro-batches",
        dest="micro_batch_counts",
        default=None,
        metavar="LIST",
        help="micro-batch counts the micro axis tries (default 1,2,4,8, those that divide "
        "the batch; a count given here that does not divide it is refused, and so are counts "
        "with an --axes that has neither micro nor stages)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        help="solve the mesh problems in N processes (default: one per core; 1: in this "
        f"one). The processes share {SEARCH_SHARE * 100:.0f}%% of the memory available "
        "when the search starts; "
        "one that outgrows its share stops the search with exit 2 and says what to narrow",
    )
    add_model_input_options(p)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "search",
        help="search the frontier of step time vs memory per device for device counts",
        description="Frontier Tracking over parallelization strategies of MODEL.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL.onnx")
    p.add_argument("--devices", default="1,2,4,8", help=f"{DEVICES_HELP} (default 1,2,4,8)")
    p.add_argument("--mesh", default="auto", help="auto (1-D and 2-D) or one shape like 2x4")
    add_search_options(p)
    add_json_flag(p, SCHEMA)
    add_json_out(p, SCHEMA)
    p.add_argument("--plot", metavar="OUT.png", help="memory vs step time per device count")
    p.add_argument(
        "--dump-costs",
        metavar="COSTS.json",
        help="the cost problems and answers: "
        "each problem's whole frontier (slower: the meshes of a device count are then "
        "solved without each other's incumbents); every frontier in it is the Pareto set "
        "of its problem's sums, so pipelined problems (--axes ...,stages: a step is its "
        "slowest stage) are left out",
    )
    p.set_defaults(func=run)


def explore_from_args(args, devices):
    """Import, cost and solve: shared by search, compile --pick and demo."""
    import multiprocessing

    from tensoropt.cli.progress import Progress
    from tensoropt.cost.cluster import load_cluster
    from tensoropt.errors import TensorOptError
    from tensoropt.search.driver import explore, mesh_label, mesh_shapes, problem_count
    from tensoropt.search.memory import fewer_collections

    jobs = getattr(args, "jobs", None)
    if jobs is not None and jobs < 1:
        raise TensorOptError(f"--jobs {jobs}: give a positive number of processes")
    if args.epsilon is not None and not 0 < args.epsilon < 1:
        raise TensorOptError(f"--epsilon {args.epsilon}: give a value in (0, 1), e.g. 0.05")
    profile = load_cluster(args.cluster)
    given = args.memory_budget
    budget = parse_bytes(given, "--memory-budget") if given is not None else None
    mesh_spec = getattr(args, "mesh", None)
    mesh_spec = "auto" if mesh_spec is None else mesh_spec  # `--mesh ""` is refused below
    if mesh_spec != "auto":  # a malformed or mismatched --mesh, before the model is read
        for d in devices:
            mesh_shapes(d, mesh_spec)
    # from the import to the last frontier: the search graph is millions of objects, and
    # a full collection traverses them all (step_segments on the GPT-3 175B shape: 0.09
    # s, or 0.7 s with one); the workers are forked with them frozen (driver._runner)
    with fewer_collections():
        sg = search_graph(args)
        space = search_space(args, sg, profile)
        check_counts(args, sg, space, devices)
        whole = bool(getattr(args, "dump_costs", None))
        total = problem_count(sg, devices, mesh_spec, space, whole)
        # the problems are counted where they are solved: in the forked workers too
        counter = multiprocessing.Value("q", 0)
        bar = Progress(total, desc="search", announce=False, count=lambda: counter.value)
        bar.describe("no device count finished yet")

        def tick(mesh):
            devices = _plural(mesh.size, "device")
            bar.describe(f"last finished: {devices}, mesh {mesh_label(mesh.shape)}")

        try:
            exp = explore(
                sg,
                devices,
                mesh_spec,
                profile,
                memory_budget=budget,
                epsilon=args.epsilon,
                jobs=getattr(args, "jobs", None),
                on_problem=tick,
                # the dumped problems carry their whole frontiers, for an external solver
                whole_frontiers=whole,
                space=space,
                counter=counter,
            )
        finally:
            bar.close()
    return sg, profile, exp


AXES_ORDER = ("split", "zero", "recompute", "micro", "stages")


def parse_axes(text: str):
    """``--axes split,zero,recompute,micro`` (any subset; split is always searched);
    ``all`` is every axis."""
    from tensoropt.errors import TensorOptError
    from tensoropt.search.driver import Axis

    names = [t.strip() for t in str(text).split(",")]
    if "" in names:  # as --devices 1,,2 is refused
        raise TensorOptError(
            f"--axes {text!r}: an empty item; give a comma list of split, zero, recompute, "
            "micro, stages, or all (e.g. --axes split,zero)"
        )
    known = {a.value: a for a in Axis}
    if "all" in names:
        names = [n for n in names if n != "all"] + list(known)
    bad = [n for n in names if n not in known]
    if bad or not names:
        what = f"unknown axis {bad[0]!r}" if bad else "no axis"
        raise TensorOptError(
            f"--axes {text!r}: {what}; give a comma list of split, zero, recompute, micro, "
            "stages, or all (e.g. --axes split,zero)"
        )
    axes = {Axis.SPLIT, *(known[n] for n in names)}
    if Axis.STAGES in axes:  # a pipeline runs micro-batches through its stages
        axes.add(Axis.MICRO)
    return frozenset(axes)


def parse_counts(text: str, flag: str = "--micro-batches", example: str = "1,2,4,8"):
    """``--micro-batches 1,2,4,8`` (or ``flag``): positive counts."""
    from tensoropt.errors import TensorOptError

    try:  # an empty item (1,,2) is refused, as in --devices and --axes
        counts = tuple(sorted({int(t) for t in str(text).split(",")}))
    except ValueError:
        counts = ()
    if not counts or counts[0] < 1:
        raise TensorOptError(f"{flag} {text!r}: give positive counts, e.g. {example}")
    return counts


def search_space(args, sg, profile=None):
    """The search space the flags ask for: with recompute, the step is built a second
    time with every block recomputed (its search graph prices those problems).

    Without --axes (``args.axes`` None) and with ``profile``: the split, and pipeline
    stages at the device counts that span more than one of the cluster's nodes, their
    micro-batched problems feeding the pipelines only; ``--stages 1`` leaves the stages
    out. Without a profile, the split alone."""
    from tensoropt.search.driver import Axis, SearchSpace

    given = getattr(args, "axes", None)
    text = getattr(args, "micro_batch_counts", None)
    counts = parse_counts("1,2,4,8" if text is None else text)  # `--micro-batches ""` refused
    text = getattr(args, "stage_counts", None)
    text = "2,4,8,16,32,64" if text is None else text
    stages = tuple(c for c in parse_counts(text, "--stages", "2,4,8") if c > 1)
    above = 0
    if given is None:
        axes = frozenset({Axis.SPLIT})
        if profile is not None and stages:
            axes |= {Axis.STAGES}
            above = profile.devices_per_node
    else:
        axes = parse_axes(given)
    if Axis.STAGES in axes and getattr(args, "stage_counts", None) is None:
        # the default counts the model has blocks for (a count given is checked instead)
        from tensoropt.passes.stages import step_segments

        blocks = step_segments(sg.graph, sg.data_inputs).count
        stages = tuple(c for c in stages if c <= blocks)
        if not stages and given is None:  # too few blocks to pipeline
            axes, above = axes - {Axis.STAGES}, 0
    recomputed, names = None, ()
    if Axis.RECOMPUTE in axes:
        recomputed, names = recomputed_graph(args)
    return SearchSpace(axes, counts, recomputed, names, stage_counts=stages, stages_above=above)


def check_counts(args, sg, space, devices) -> None:
    """Refuse (TensorOptError, exit 2) micro-batch and stage counts given on the command
    line that no problem can use: a micro-batch count that does not divide the batch, a
    stage count above the model's blocks, or one that divides no searched device count.
    The default lists are filtered silently."""
    from tensoropt.errors import TensorOptError
    from tensoropt.search.driver import Axis

    given = getattr(args, "micro_batch_counts", None)
    named = getattr(args, "axes", None) is not None
    if given is not None and named and not space.axes & {Axis.MICRO, Axis.STAGES}:
        # --axes names what is searched, and the counts apply to the micro axis and to
        # pipelines, neither asked for. (Without --axes they are the counts of the default
        # pipelines, which a search with no count above a node leaves out.)
        raise TensorOptError(
            f"--micro-batches {given}: the micro axis is not searched here; add micro to "
            "--axes (e.g. --axes split,micro)"
        )
    if given is not None and space.axes & {Axis.MICRO, Axis.STAGES}:
        bad = [k for k in space.micro_batches if k > 1 and sg.batch % k]
        if bad:
            fits = [k for k in range(2, min(sg.batch, 64) + 1) if sg.batch % k == 0][:6]
            raise TensorOptError(
                f"--micro-batches {given}: {', '.join(map(str, bad))} "
                f"{'does' if len(bad) == 1 else 'do'} not divide the "
                f"batch of {sg.batch} samples; give counts that divide it, e.g. "
                f"{','.join(map(str, fits)) or '1'}"
            )
    given = getattr(args, "stage_counts", None)
    if given is None or Axis.STAGES not in space.axes or not space.stage_counts:
        return
    from tensoropt.passes.stages import step_segments

    blocks = step_segments(sg.graph, sg.data_inputs).count
    over = [p for p in space.stage_counts if p > blocks]
    if over:
        raise TensorOptError(
            f"--stages {given}: the model has {blocks} blocks to cut between stages; "
            f"give stage counts of at most {blocks}"
        )
    piped = [d for d in devices if d > space.stages_above]
    unused = [p for p in space.stage_counts if not any(d % p == 0 for d in piped)]
    if unused and space.stages_above:
        raise TensorOptError(
            f"--stages {given}: {', '.join(map(str, unused))} divides none of the device "
            f"counts above {space.stages_above} (by default stages are searched across "
            f"nodes of {space.stages_above} devices); add --axes split,stages to search "
            "them at every count"
        )
    if unused:
        raise TensorOptError(
            f"--stages {given}: {', '.join(map(str, unused))} divides none of the device "
            f"counts {','.join(map(str, devices))}; each stage runs on devices/stages devices"
        )


def recomputed_graph(args):
    """The search graph of the step with every block recomputed, and the block names
    (None and () when the model has no block to recompute)."""
    from tensoropt.cli.common import build_step
    from tensoropt.cost.model import search_graph_of
    from tensoropt.passes.recompute import apply_recompute, find_blocks

    step = build_step(args, load_weights=False)
    blocks = find_blocks(step.model.graph, step.signature.data_inputs)
    if not blocks:
        return None, ()
    names = tuple(b.name for b in blocks)
    apply_recompute(step.model, step.signature.data_inputs, names)
    return search_graph_of(step), names


def per_device_points(exp):
    """{devices: [(MeshSearch, FrontierPoint)]}, non-dominated within each device count."""
    from tensoropt.search.driver import device_frontier

    return {d: device_frontier(exp, d) for d in sorted({s.devices for s in exp.searches})}


def _sample(rows, limit=10):
    if len(rows) <= limit:
        return list(enumerate(rows))
    picks = sorted({round(i * (len(rows) - 1) / (limit - 1)) for i in range(limit)})
    return [(i, rows[i]) for i in picks]


def _columns(
    header: Sequence[str] | None,
    rows: Sequence[Sequence[str]],
    least: Sequence[int],
    left: Collection[int] = (),
) -> list[str]:
    """Table lines (the header's first, when given): the first ``len(least)`` columns
    right-aligned (those in ``left`` left-aligned), each at least as wide as given and as
    wide as its widest cell (a 10,001-point frontier's index, GPT-3's 10441.516 GiB, a
    pipelined mesh ``pp2:32x16``); a column after them is free text, two spaces on."""
    n = len(least)
    lines = [header, *rows] if header is not None else list(rows)
    widths = [max([w, *(len(r[c]) for r in lines)]) for c, w in enumerate(least)]
    out = []
    for cells in lines:
        fixed = (
            cell.ljust(w) if c in left else cell.rjust(w)
            for c, (cell, w) in enumerate(zip(cells[:n], widths, strict=True))
        )
        out.append("  " + " ".join(fixed) + "".join(f"  {cell}" for cell in cells[n:]))
    return out


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def print_tables(sg, exp, out=None, band=None) -> None:
    """The per-device-count frontiers, the reference plans and the overall frontier.
    ``band``: the profile's ErrorBand (cost.accuracy): each table says how far its
    estimates typically are off and marks the points it cannot order. Under the
    guarantee, the axes searched (``exp.space``) and those left out."""
    from tensoropt.cost.accuracy import near_ties
    from tensoropt.search.driver import (
        REFERENCE_NAMES,
        guarantee_of,
        mesh_label,
        reference_gaps,
    )
    from tensoropt.search.merge import fewer_devices, fewer_note

    out = out or sys.stdout
    table = per_device_points(exp)
    budget = exp.memory_budget
    tied = False
    fewer = fewer_devices(
        {d: [(p.time_s, p.memory_bytes) for _, p in rows] for d, rows in table.items()}
    )
    matched = False
    for d, rows in table.items():
        if not rows:
            print(f"\n{_plural(d, 'device')}: no plan fits the memory budget", file=out)
            continue
        head = f"\n{_plural(d, 'device')}: {_plural(len(rows), 'frontier point')}"
        shown = _sample(rows)
        if len(shown) < len(rows):
            head += f" ({len(shown)} shown, evenly spaced from fastest to least memory)"
        width = band.time(d) if band is not None else None
        if width is not None:
            head += f"; {band.describe(d)}"
        print(head, file=out)
        marks = near_ties([p.time_s for _, (_, p) in shown], width)
        tied = tied or any(marks)
        plans = [s.summaries[exp.index_of(s, p)] for _, (s, p) in shown]
        for k, (_, (_, p)) in enumerate(shown):
            note = fewer_note(fewer(d, p.time_s, p.memory_bytes), plans[k])
            plans[k] += note
            matched = matched or bool(note)
        cells = [
            (str(i), mesh_label(s.mesh.shape, s.variant.stages), fmt_step_time(p.time_s),
             "~" if mark else "", fmt_memory(p.memory_bytes), f"{sg.batch / p.time_s:.1f}",
             plan)
            for (i, (s, p)), mark, plan in zip(shown, marks, plans, strict=True)
        ]  # fmt: skip
        header = ("pick", "mesh", "step time", "", "memory/dev", "samples/s", "plan")
        for line in _columns(header, cells, (4, 8, 12, 1, 12, 11)):
            print(line, file=out)
    print(
        "  (pick: the point's index at its device count, for `compile --devices N --pick INDEX`)",
        file=out,
    )
    if matched:
        print(
            "  (no better than N devices: a plan on fewer devices, N, is as fast with no more "
            "memory per device)",
            file=out,
        )
    if tied:
        print(
            "  (~: step time within the error band of the row above: the estimate cannot "
            "order the two; compare them with `tensoropt validate`)",
            file=out,
        )
    link = band.link_note(max(table, default=1)) if band is not None else None
    if link is not None:
        print(f"  (memory link: {link})", file=out)
    print("\nreference plans on the same cost model (best mesh per device count):", file=out)
    cells = []
    for d in table:
        for name in REFERENCE_NAMES:
            best = None
            for s in exp.searches:
                if s.devices == d and name in s.references:
                    t, m, _ = s.references[name]
                    if best is None or t < best[0]:
                        best = (t, m, mesh_label(s.mesh.shape, s.variant.stages))
            if best:
                over = ["over the memory budget"] if budget is not None and best[1] > budget else []
                cells.append((_plural(d, "device"), name, "mesh", best[2], fmt_step_time(best[0]),
                              fmt_memory(best[1]), *over))  # fmt: skip
    for line in _columns(None, cells, (11, 18, 4, 8, 12, 12), left={1}):
        print(line, file=out)
    for d in table:  # the references the axes call for that no mesh of d holds, and why
        for name, reason in reference_gaps(exp, d).items():
            print(f"  {_plural(d, 'device')} {name}: none ({reason})", file=out)
    merged = list(exp.merged)
    shown = _sample(merged, 20)
    head = f"\noverall frontier over (devices, step time, memory/device): {len(merged)} points"
    if len(shown) < len(merged):
        head += f" ({len(shown)} shown, evenly spaced)"
    print(head, file=out)
    # each point's index in its device count's table above (what --pick takes), and what
    # it uses besides the split, when some shown point uses more
    picks = {
        (s.key, exp.index_of(s, p)): i for rows in table.values() for i, (s, p) in enumerate(rows)
    }
    sources = [exp.source_of(p) for _, p in shown]
    labels = [s.variant.label(len(s.blocks)) for s in sources]
    uses = any(labels)
    cells = [
        (str(i), str(p.devices), str(picks.get((search.key, p.index), "-")),
         mesh_label(p.mesh, search.variant.stages), fmt_step_time(p.time_s),
         fmt_memory(p.memory_bytes), *([label or "split only"] if uses else ()))
        for (i, p), search, label in zip(shown, sources, labels, strict=True)
    ]  # fmt: skip
    header = ("n", "devices", "pick", "mesh", "step time", "memory/dev", *(["uses"] * uses))
    for line in _columns(header, cells, (3, 7, 5, 8, 12, 12)):
        print(line, file=out)
    print(
        "  (n: the position in this overall frontier, fastest first; not a --pick index;\n"
        "   pick: the point's index at its device count, for `compile --devices N --pick "
        "INDEX`)",
        file=out,
    )
    if exp.searches:
        print(f"\nguarantee: {guarantee_of(exp)}", file=out)
    from tensoropt.search.driver import idle_axes

    print(f"axes: {axes_line(exp.space.axes, exp.space.stages_above, idle_axes(exp))}", file=out)


def axes_line(axes, stages_above: int = 0, idle=None) -> str:
    """Which axes a search explored and which it left out (the guarantee holds over the
    plans of the first). ``stages_above``: the stages were searched only at the device
    counts above it (the default search's stages, across nodes). ``idle``: asked axes
    that gave no problem, and why (:func:`idle_axes`); they count as not searched."""
    from tensoropt.search.driver import Axis

    idle = idle or {}
    searched = [a.value for a in Axis if a in axes and a not in idle]
    left = [a.value for a in Axis if a not in axes]
    where = ""
    if Axis.STAGES in axes and stages_above:
        where = (
            f" (stages above {stages_above} devices: across nodes, each pipeline's "
            "micro-batches within it; --stages 1 leaves them out)"
        )
    empty = "".join(f"; {a.value} has no plan here: {why}" for a, why in idle.items())
    if not left:
        every = "" if idle else " (every axis)"
        return "searched " + ",".join(searched) + where + every + empty
    return (
        f"searched {','.join(searched)}{where}{empty}; not searched: {', '.join(left)} "
        "(--axes all adds them; each multiplies the search time, see --help)"
    )


def plot(exp, path: str) -> None:
    """The report's frontier figure: a staircase per device count, the reference plans
    of each count on their best mesh, and the memory budget when there is one."""
    import io

    from tensoropt.report import analysis, plots

    buffer = io.BytesIO()
    plots.frontier(
        analysis.device_frontiers(exp),
        analysis.references(exp),
        buffer,
        "Frontier of step time vs memory per device",
        budget=exp.memory_budget,
    )
    write_atomic(path, buffer.getvalue())


def run(args: argparse.Namespace) -> int:
    from tensoropt.cli.json_output import document, emit
    from tensoropt.cli.search_json import search_document, step_options
    from tensoropt.cost.accuracy import band_of
    from tensoropt.ir.costs import CostRecord, costs_to_json

    devices = parse_devices(args.devices)
    for flag, path in (
        ("--json-out", args.json_out),
        ("--plot", args.plot),
        ("--dump-costs", args.dump_costs),
    ):
        check_output_file(path, flag)
    sg, profile, exp = explore_from_args(args, devices)
    band = band_of(args.cluster)
    if not args.json:  # with --json, stdout is the document alone
        print_tables(sg, exp, band=band)
    if args.json or args.json_out:
        body = search_document(sg, profile, exp, args.model, step_options(args), band)
        emit(args, document(SCHEMA, body), compact=True)
    if args.plot:
        plot(exp, args.plot)
    if args.dump_costs:
        # a pipelined point's step is its slowest stage's, not a sum of its problem's
        # entries: its frontier cannot be recomputed from the file, so it is not there
        summed = [s for s in exp.searches if s.variant.stages == 1]
        records = [CostRecord(s.problem, s.result.points, exp.epsilon) for s in summed]
        if len(summed) < len(exp.searches):
            print(
                f"--dump-costs: {len(exp.searches) - len(summed)} pipelined problems left "
                "out (a pipeline's step is its slowest stage, not a sum of entries)",
                file=sys.stderr,
            )
        write_atomic(args.dump_costs, json.dumps(costs_to_json(records)).encode())
    written = (("json", args.json_out), ("plot", args.plot), ("costs", args.dump_costs))
    for flag, path in written:
        if path:
            print(f"wrote {flag}: {path}", file=sys.stderr)
    return 0
