"""``tensoropt inspect``: what each device graph does, sends and holds."""

from __future__ import annotations

import argparse
import json
import os
import re

from tensoropt.cli.json_output import add_json_flag
from tensoropt.display import fmt_memory, fmt_step_time
from tensoropt.errors import ModelLoadError, OutputDirError, TensorOptError

JSON_SCHEMA = "tensoropt.inspect/1"

EPILOG = """\
shows the plan's estimate (the cost model's step time, memory per device and
collectives per device: the same figures search, compile and validate report), then
per device: op count, collectives by kind and group, bytes sent per step (ring
algorithms: AllReduce 2(n-1)/n B, AllGather/ReduceScatter (n-1)/n B; a pipeline
stage's Send to the device at its position in another stage, named by that stage: its
bytes), its pipeline stage, schedule and bytes received from other stages, parameter
shard shapes, the blocks it recomputes (`compile --recompute`) with the forward nodes
each reruns (the first 8 blocks, and their first 8 nodes by name; --json names every
one), and memory: parameters + optimizer state, and the *liveness peak*, a second
figure: every tensor alive at once when the graph runs node by node in file order. The
estimate counts what a step holds (parameters, gradients, optimizer state, activations
saved for the backward, converted buffers); the liveness peak is what one sequential
schedule holds, without the runtime's allocator or segment boundaries. What the plan
decides for every device (its ZeRO stages, and the recomputed blocks when every device
reruns the same) is printed once, under "every device:"; devices whose figures are all
alike (a data-parallel mesh's ranks) print one section under all their names, and
those that differ (other collective groups, another pipeline stage) one each.

--json prints, on stdout alone: the mesh, the plan's source and the estimate (null for a
single device file, which carries none), then per device the same figures as the table,
byte counts as integers.

examples:
  tensoropt inspect out/
  tensoropt inspect out/device_0.onnx --json
"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="show ops, collectives, traffic and memory of compiled device graphs",
        description="Inspect a compiled output directory or one device_<k>.onnx.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", metavar="OUTDIR|FILE.onnx")
    add_json_flag(p, JSON_SCHEMA)
    p.set_defaults(func=run)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _targets(target: str) -> tuple[list[str], list[str], list[str], dict]:

    from tensoropt.passes.training_step import read_signature

    if os.path.isdir(target):
        from tensoropt.runtime.manifest import load_outdir

        # names checked (plain files inside OUTDIR); weights are never read, only graphs
        manifest = load_outdir(target, check_files=False)
        files = [str(manifest.device_path(r.rank)) for r in manifest.ranks]
        with open(os.path.join(target, "manifest.json")) as f:
            raw = json.load(f)  # load_outdir checked it parses
        about = {
            "mesh": raw.get("mesh"),
            "plan_source": _plan_source(target),
            "estimate": raw.get("estimate"),
        }
        return files, list(manifest.step["params"]), list(manifest.step["states"]), about
    if not os.path.isfile(target):
        raise TensorOptError(f"{target}: no such file or directory")
    if target.endswith(".json"):
        raise TensorOptError(
            f"{target}: a JSON file (a plan or manifest?); give the output directory of "
            "`tensoropt compile` or one of its device_<k>.onnx"
        )
    model = _load(target)
    try:
        sig = read_signature(model)
    except TensorOptError as exc:
        raise TensorOptError(f"{target}: {exc}") from None
    return [target], list(sig.params), list(sig.states), dict.fromkeys(_ABOUT)


_ABOUT = ("mesh", "plan_source", "estimate")  # what only an output directory knows


def _plan_source(outdir: str) -> str | None:
    path = os.path.join(outdir, "plan.json")
    try:
        with open(path) as f:
            return str(json.load(f).get("source", ""))
    except (OSError, ValueError, AttributeError):
        return None


def _zero_line(target: str) -> str | None:
    """The plan's ZeRO stages (``zero: stage 3 on 32 units``), from plan.json; None when
    no unit uses ZeRO or the target is not an output directory."""
    if not os.path.isdir(target):
        return None
    try:
        with open(os.path.join(target, "plan.json")) as f:
            units = json.load(f).get("units", {})
        stages = [u.get("zero", 0) for u in units.values()]
    except (OSError, ValueError, AttributeError):
        return None
    counts = {z: stages.count(z) for z in sorted(set(stages)) if z}
    if not counts:
        return None
    return "zero: " + ", ".join(f"stage {z} on {n} units" for z, n in counts.items())


def _load(path: str):
    """The ONNX model at ``path`` (weights left on disk); bad files are bad input."""
    import onnx
    from google.protobuf.message import DecodeError

    try:  # binary ONNX whatever the name: a .json would go to the JSON parser
        return onnx.load(path, format="protobuf", load_external_data=False)
    except (DecodeError, OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(
            f"{path}: not a readable ONNX model ({first}); recompile or re-export it"
        ) from None


def _replicates_all_work(report) -> bool:
    """Several device graphs and not one collective: each runs the whole step."""
    return len(report) > 1 and not any(s.collectives for _, s in report)


def _relation(peak: float, estimate: dict) -> str:
    memory = estimate["memory_bytes"]
    return f" ({peak / memory:.2f}x the estimate)" if memory else ""


def run(args: argparse.Namespace) -> int:
    from tensoropt.passes.device_stats import device_stats

    files, params, states, about = _targets(args.target)
    report = []
    recomputed = []
    for path in files:
        if not os.path.isfile(path):
            raise OutputDirError(f"{path}: missing; recompile the output directory")
        model = _load(path)
        stats = device_stats(model, params, states)
        report.append((os.path.basename(path), stats))
        recomputed.append(_recomputed(model))
    if args.json:
        from tensoropt.cli.json_output import document, emit

        body = {
            **about,
            "replicates_all_work": _replicates_all_work(report),
            "devices": [
                {
                    "file": name,
                    "ops": s.ops,
                    "op_types": s.op_types,
                    "collectives": [
                        {
                            "kind": c.kind,
                            "group": list(c.group),
                            "count": c.count,
                            "bytes_sent": c.bytes_sent,
                        }
                        for c in s.collectives
                    ],
                    "bytes_sent_per_step": s.bytes_sent,
                    "param_shapes": {k: list(v) for k, v in s.param_shapes.items()},
                    "param_and_state_bytes": s.state_bytes,
                    "liveness_peak_bytes": s.peak_bytes,
                    "micro_batches": s.micro_batches,
                    "pipeline": None
                    if s.stage is None
                    else {**s.stage, "bytes_received_per_step": s.bytes_received},
                    "recompute": {b: list(nodes) for b, nodes in rc.items()},
                }
                for (name, s), rc in zip(report, recomputed, strict=True)
            ],
        }
        emit(args, document(JSON_SCHEMA, body))
        return 0
    estimate = about.get("estimate")
    if estimate:
        print(
            f"estimate ({estimate['cluster']}): step {fmt_step_time(estimate['time_s'])}, "
            f"{fmt_memory(estimate['memory_bytes'])} per device, "
            f"{estimate['collectives_per_device']} collectives per device"
        )
    if _replicates_all_work(report):
        from tensoropt.cli.cmd_compile import REPLICATED_NOTE

        print(f"no collectives on {len(report)} devices: {REPLICATED_NOTE}")
    # What the plan decides for every device is said once: its ZeRO stages, and the
    # recomputed blocks when every device reruns the same (pipeline stages differ).
    # (one device file: below its figures, as every line about it)
    shared = [_zero_line(args.target)]
    same_blocks = len(report) > 1 and all(rc == recomputed[0] for rc in recomputed)
    if same_blocks:
        shared += _recompute_lines(recomputed[0])
    shared = [line for line in shared if line]
    if shared:
        print("every device:")
    for line in shared:
        print(f"  {line}")
    # devices whose figures are alike print once, under all their names
    groups: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for (name, s), rc in zip(report, recomputed, strict=True):
        head, body = _device_section(s, estimate, _rank_of(name))
        if not same_blocks:
            body += [f"  {line}" for line in _recompute_lines(rc)]
        groups.setdefault((head, tuple(body)), []).append(name)
    for (head, body), names in groups.items():
        print(f"{_device_names(names)}: {head}")
        for line in body:
            print(line)
    return 0


def _rank_of(name: str) -> int | None:
    found = re.fullmatch(r"device_(\d+)\.onnx", name)
    return int(found.group(1)) if found else None


def _peer(s, rank: int | None, peer: int) -> str:
    """Where a Send goes, as the stage it reaches: "stage 1" for the device at this
    device's position in that stage (every pipeline Send), else with the device named;
    so the devices of one stage print alike."""
    per = s.stage["ranks_per_stage"]
    where = f"stage {peer // per}"
    return where if rank is not None and peer % per == rank % per else f"{where} device {peer}"


def _device_section(s, estimate, rank: int | None = None) -> tuple[str, list[str]]:
    """One device's figures: the head line (after its name) and the lines below it;
    ``rank``: the device's rank, which names its Send peers by stage."""
    head = (
        f"{s.ops} ops, sends {_fmt_bytes(s.bytes_sent)} per step, "
        f"params+state {_fmt_bytes(s.state_bytes)}, "
        f"liveness peak {_fmt_bytes(s.peak_bytes)}"
        + (_relation(s.peak_bytes, estimate) if estimate else "")
    )
    body = []
    if s.micro_batches > 1:
        body.append(
            f"  micro-batches: {s.micro_batches} per step, {s.accumulated} values "
            "accumulated (counts and bytes below are per step)"
        )
    if s.stage is not None:
        body.append(
            f"  pipeline stage {s.stage['stage']} of {s.stage['stages']} "
            f"({s.stage['schedule']}): receives {_fmt_bytes(s.bytes_received)} per "
            "step from other stages (Send rows below: to the device at its position in "
            "the stage named)"
        )
    if s.collectives:
        body.append(f"  {'collective':<14} {'group':<24} {'count':>5} {'sent/step':>12}")
        for c in s.collectives:
            group = ",".join(map(str, c.group))
            if c.kind == "Send" and s.stage is not None and len(c.group) == 1:
                group = _peer(s, rank, c.group[0])
            body.append(f"  {c.kind:<14} {group:<24} {c.count:>5} {_fmt_bytes(c.bytes_sent):>12}")
    shown = list(s.param_shapes.items())
    body.append(
        "  parameter shards: "
        + ", ".join(f"{k} {'x'.join(map(str, v))}" for k, v in shown[:8])
        + (f" (+{len(shown) - 8} more)" if len(shown) > 8 else "")
    )
    return head, body


SHOWN_NODES = 8  # forward nodes named per recomputed block (--json lists every one)
SHOWN_BLOCKS = 8  # recomputed blocks given a line each; the rest are counted


def _recompute_lines(rc: dict[str, list[str]]) -> list[str]:
    """Per recomputed block, the first :data:`SHOWN_BLOCKS` in block order: the forward
    nodes its clones rerun, the first :data:`SHOWN_NODES` of them by name; then one line
    that counts the other blocks and their nodes."""
    out = []
    ordered = sorted(rc.items(), key=lambda item: _natural(item[0]))
    rest = ordered[SHOWN_BLOCKS:]
    for block, nodes in ordered[:SHOWN_BLOCKS]:
        reruns = f"{len(nodes)} node" + ("s" if len(nodes) != 1 else "")
        more = len(nodes) - SHOWN_NODES
        names = ", ".join(nodes[:SHOWN_NODES]) + (
            f" (+{more} more; --json lists them all)" if more > 0 else ""
        )
        out.append(f"recompute {block}: reruns {reruns}: {names}")
    if rest:
        count = sum(len(nodes) for _, nodes in rest)
        out.append(
            f"recompute {rest[0][0]} ... {rest[-1][0]}: {len(rest)} more blocks, rerunning "
            f"{count} nodes (--json lists them all)"
        )
    return out


def _natural(name: str) -> tuple:
    """``block_2`` before ``block_10``."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _device_names(names: list[str]) -> str:
    """``device_0.onnx``, or for devices alike their names, runs of three or more
    consecutive devices shortened: ``device_0.onnx ... device_7.onnx (8 devices alike)``."""
    if len(names) == 1:
        return names[0]
    found = [re.fullmatch(r"device_(\d+)\.onnx", n) for n in names]
    if not all(found):
        return f"{', '.join(names)} ({len(names)} devices alike)"
    ks = [int(m.group(1)) for m in found if m]
    runs: list[list[int]] = []
    for k in ks:
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    parts = []
    for run in runs:
        if len(run) >= 3:
            parts.append(f"device_{run[0]}.onnx ... device_{run[-1]}.onnx")
        else:
            parts += [f"device_{k}.onnx" for k in run]
    return f"{', '.join(parts)} ({len(names)} devices alike)"


def _recomputed(model) -> dict[str, list[str]]:
    """Per recomputed block (``passes.recompute``): the forward nodes its clones rerun."""
    from tensoropt.passes.recompute import RECOMPUTE_KEY, RECOMPUTE_OF_KEY

    out: dict[str, list[str]] = {}
    for node in model.graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        if RECOMPUTE_KEY in meta and RECOMPUTE_OF_KEY in meta:
            out.setdefault(meta[RECOMPUTE_KEY], []).append(meta[RECOMPUTE_OF_KEY])
    return out
