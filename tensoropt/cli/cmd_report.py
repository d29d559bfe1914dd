"""``tensoropt report``: the trade-off study of one model on one cluster, as a directory."""

from __future__ import annotations

import argparse
import os
import sys
import time

from tensoropt.cli.cmd_search import add_search_options, explore_from_args
from tensoropt.cli.common import DEVICES_HELP, check_output_dir, parse_devices
from tensoropt.cli.json_output import add_json_flag
from tensoropt.errors import TensorOptError

EPILOG = """\
what it does: runs the same search as `tensoropt search` (every mesh of every device
count, Frontier Tracking, merged frontier) and writes REPORT_DIR/report.md with PNG
figures:
  1. the frontier per device count (memory per device vs step time), with the
     data-parallel and Megatron plans marked, and a few plans per device count;
  2. the fastest plan for each memory capacity per device (16..141 GiB and the
     model's own range), naming the device count and mesh;
  3. the fewest devices for each step-time target, without and within capacities;
  4. how the chosen strategies change along the frontier at --detail-devices
     (default 8 and the largest): a heatmap and sentences derived from it;
  5. data-parallel and Megatron plans against the frontier (speed-up, memory saving).
The directory is written completely or not at all; an existing report is replaced.

examples:
  tensoropt report gpt.onnx --devices 1..64 --cluster v100 -o report/
  tensoropt report bert-large.onnx --devices 1..64 --cluster h100 --epsilon 0.02 -o bert-h100/
"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report",
        help="write a markdown + PNG study of the time/memory/devices trade-offs",
        description="Search the frontier of MODEL and write a trade-off report.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL.onnx")
    p.add_argument("--devices", default="1..64", help=f"{DEVICES_HELP} (default 1..64)")
    p.add_argument("--mesh", default="auto", help="auto (1-D and 2-D) or one shape like 2x4")
    add_search_options(p)
    p.add_argument(
        "--detail-devices",
        metavar="N[,N]",
        help="device counts whose strategies are drawn (default: 8 and the largest)",
    )
    p.add_argument("-o", "--output", required=True, metavar="REPORT_DIR")
    add_json_flag(p, "tensoropt.report/1")
    p.set_defaults(func=run)


def _model_name(path: str) -> str:
    """``gpt (paper preset)`` for zoo models, else the file name."""
    import onnx

    from tensoropt.models import zoo_info

    try:
        info = zoo_info(onnx.load(path, load_external_data=False))
    except Exception:  # the search already read the file; a name is all we want here
        info = None
    if info is None:
        return os.path.basename(path)
    return f"{info.name} ({info.preset} preset)"


def _param_count(sg) -> int:
    total = 0
    for name in sg.params:
        value = sg.graph.initializers.get(name)
        if value is None or value.shape is None:
            continue
        count = 1
        for dim in value.shape:
            count *= int(dim)
        total += count
    return total


def search_for_report(args: argparse.Namespace):
    """(header, profile, exploration, detail device counts): everything but the writing."""
    from tensoropt.cli.cmd_search import axes_line
    from tensoropt.report.build import prepare_report_dir
    from tensoropt.report.render import Header
    from tensoropt.search.driver import guarantee_of, idle_axes

    check_output_dir(args.output, "-o")
    devices = parse_devices(args.devices)
    detail = (
        tuple(parse_devices(args.detail_devices, "--detail-devices")) if args.detail_devices else ()
    )
    missing = [d for d in detail if d not in devices]
    if missing:
        raise TensorOptError(
            f"--detail-devices {','.join(map(str, missing))}: not among the searched device "
            f"counts {','.join(map(str, devices))}"
        )
    os.rmdir(prepare_report_dir(args.output))  # refuse a bad -o before the long search
    start = time.perf_counter()
    sg, profile, exp = explore_from_args(args, devices)
    head = Header(
        model=_model_name(args.model),
        model_path=os.path.basename(args.model),
        params=_param_count(sg),
        batch=sg.batch,
        optimizer=args.optimizer,
        devices=tuple(devices),
        mesh_spec=args.mesh,
        meshes=len(exp.searches),
        epsilon=exp.epsilon,
        memory_budget=exp.memory_budget,
        guarantee=guarantee_of(exp),
        seconds=time.perf_counter() - start,
        axes=axes_line(exp.space.axes, exp.space.stages_above, idle_axes(exp)),
        estimates=estimates_line(args.cluster, max(devices)),
    )
    return head, profile, exp, detail


def estimates_line(cluster: str, devices: int) -> str | None:
    """How far the profile's estimates are typically off, and the memory-link case they
    assume (``ErrorBand.overview``); None for a built-in profile (nothing was measured)."""
    from tensoropt.cost.accuracy import band_of

    band = band_of(cluster)
    return (band.overview(devices) or None) if band is not None else None


def run(args: argparse.Namespace) -> int:
    from tensoropt.report.build import ReportOptions, write_report

    head, profile, exp, detail = search_for_report(args)
    names = write_report(exp, head, profile, args.output, ReportOptions(detail_devices=detail))
    if args.json:
        from tensoropt.cli.json_output import document, emit

        body = {
            "report": os.path.join(args.output, names[0]),
            "files": [os.path.join(args.output, name) for name in names],
            "devices": list(head.devices),
            "meshes": head.meshes,
            "frontier_points": len(exp.merged),
            "guarantee": head.guarantee,
        }
        emit(args, document("tensoropt.report/1", body))
    else:
        print(f"wrote {os.path.join(args.output, names[0])} and {len(names) - 1} figures")
    print(f"guarantee: {head.guarantee}", file=sys.stderr)
    return 0
