"""The cost model's estimates against measurements on this machine (``tensoropt validate``).

1. A calibrated profile: ``tensoropt calibrate`` (mpi, 2 ranks) unless --cluster is given.
2. For each zoo model (small presets, or tiny CNNs, sized so compute is measurable):
   ``tensoropt validate MODEL --devices 1,2 --points K`` -- K frontier points per
   device count, compiled as ``compile --pick`` does and run with ``run --profile``
   on the mpi backend (one thread per rank, as calibrated).
3. Median |relative error| of step time and of per-rank memory over all plans, and
   per term: compute (the plan costed with free communication, against the measured
   sum of segment times), communication (the model's, the emitted graph's
   collectives priced at the calibrated link, and the measured collective time),
   memory (the search's estimate, the estimate plus the parameter and optimizer-state
   shards that the runtime holds twice -- inputs and ``__new`` outputs --, the static
   liveness peak, and the measured growth of anonymous resident memory).

With ``--pipelined``: the pipelined problems' own frontiers at 2 devices (``validate
--devices 2 --axes split,stages --pipelined``: 2 stages of one device each), against
the targets step time within 20% median and memory within 15%, written to
its own subsection of "## Pipeline stages".

Usage: python benchmarks/bench_validate.py [--cluster FILE.json] [--points K] [--write]
       [--models LIST] [--axes split,zero,recompute,micro] [--optimizer adam]
       [--pipelined]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

from results import RESULTS, write_section

from tensoropt.calibrate.validate import host_label

SECTION = "## Estimates against measurements"
SUBSECTION = "### Latest validate run"
AXES_SUBSECTION = "### Latest validate run with the memory axes"
PIPELINE_SECTION = "## Pipeline stages"
PIPELINE_SUBSECTION = "### Latest validate run: pipelined plans"
MODELS = ("mlp:small", "gpt:small", "vgg16:tiny", "resnet50:tiny")
# zoo NAME:PRESET, or export:gpt2 (a real torch.onnx export, see export_model)


def _main(argv: list[str]) -> tuple[int, str]:
    from tensoropt.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(argv)
    return code, out.getvalue()


def calibrate(path: Path) -> None:
    code, out = _main(["calibrate", "-o", str(path)])
    if code != 0:
        raise SystemExit(f"calibrate failed ({code}): {out}")


def export_model(name: str, path: Path) -> None:
    """A real ``torch.onnx.export(dynamo=True)`` of the test suite's torch model ``name``
    (tests/exports/models.py), at the zoo's small transformer size: 4 layers, hidden 256,
    8 heads, batch 8, sequence 64, vocabulary 512."""
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.exports.models import GPT2, _perturb_norms

    if name != "gpt2":
        raise SystemExit(f"export:{name}: the only export model is export:gpt2")
    torch.manual_seed(0)
    model = GPT2(vocab=512, dim=256, heads=8, layers=4, max_pos=64, seq=64)
    _perturb_norms(model)
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(0))
    torch.onnx.export(
        model.eval(), (), str(path), kwargs={"input_ids": ids}, input_names=["input_ids"],
        dynamo=True, external_data=False,
    )  # fmt: skip


def model_file(model: str, tmp: Path) -> Path:
    """The ONNX file of ``model`` (zoo NAME:PRESET, or export:gpt2) written under ``tmp``."""
    from tensoropt.models import build_model, save_model

    name, preset = model.split(":")
    path = tmp / f"{name}-{preset}.onnx"
    if name == "export":
        export_model(preset, path)
    else:
        save_model(build_model(name, preset), str(path))
    return path


def validate(model: str, cluster: Path, tmp: Path, args) -> dict:
    path = model_file(model, tmp)
    out = path.with_suffix(".json")
    argv = ["validate", str(path), "--devices", "2" if args.pipelined else "1,2",
            "--cluster", str(cluster), "--points", str(args.points),
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--rounds", str(args.rounds),
            "--json-out", str(out), "--axes", args.axes, "--optimizer", args.optimizer]  # fmt: skip
    if args.pipelined:
        argv.append("--pipelined")
    code, text = _main(argv)
    if code != 0:
        raise SystemExit(f"validate {model} failed ({code}): {text}")
    data = json.loads(out.read_text())
    for r in data["results"]:
        r["model"] = model
    return data


def _err(est: float, meas: float) -> float:
    return (est - meas) / meas if meas > 0 else float("inf")


def _med(values) -> float:
    values = [abs(v) for v in values]
    return statistics.median(values) if values else float("nan")


def _link(probe: dict | None) -> str:
    """The memory-link probe taken before a multi-device plan ran (tensoropt.calibrate.memlink)."""
    if not probe:
        return "-"
    return f"{'shared' if probe['shared'] else 'own'} {probe['ratio']:.2f}"


def _hosted(plans: list[dict]) -> list[dict]:
    return [p for p in plans if p.get("time_rel_error_host_corrected") is not None]


def _on_link(plans: list[dict], shared: bool) -> list[dict]:
    return [p for p in plans if (p["measured"].get("memory_link") or {}).get("shared") is shared]


def _uses_axes(plan: dict) -> bool:
    a = plan.get("axes") or {}
    return a.get("micro_batches", 1) > 1 or a.get("zero", 0) > 0 or a.get("recompute_blocks", 0) > 0


def rows_and_summary(plans: list[dict]) -> tuple[list[str], list[str]]:
    rows = [
        "| model | dev | mesh | pt | est ms | meas ms | time err | est comp ms | meas comp"
        " ms (cpu) | comp err | link | host | model comm ms | graph comm ms (coll.) | meas comm ms"
        " | est MiB | +state MiB | liveness MiB | meas MiB | mem err | +state err |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:"
        "|---:|---:|---:|",
    ]
    for p in plans:
        e, m = p["estimate"], p["measured"]
        plus = e["memory_bytes"] + e["state_bytes"]
        rows.append(
            f"| {p['model']} | {p['devices']} | {'x'.join(map(str, p['mesh']))} | {p['point']} "
            f"| {e['time_s'] * 1e3:.2f} | {m['time_s'] * 1e3:.2f} | {p['time_rel_error']:+.0%} "
            f"| {e['compute_s'] * 1e3:.2f} | {m['compute_s'] * 1e3:.2f} "
            f"({m['compute_cpu_s'] * 1e3:.2f}) | {p['compute_rel_error']:+.0%} "
            f"| {_link(m.get('memory_link'))} | {host_label(m.get('host_speed_ratio'))} "
            f"| {e['comm_s'] * 1e3:.2f} | {e['graph_comm_s'] * 1e3:.2f} ({e['graph_collectives']})"
            f" | {m['comm_s'] * 1e3:.2f} | {e['memory_bytes'] / 2**20:.2f} "
            f"| {plus / 2**20:.2f} | {e['liveness_peak_bytes'] / 2**20:.2f} "
            f"| {m['memory_bytes'] / 2**20:.2f} | {p['memory_rel_error']:+.0%} "
            f"| {_err(plus, m['memory_bytes']):+.0%} |"
        )
    one = [p for p in plans if p["devices"] == 1]
    two = [p for p in plans if p["devices"] == 2]
    axes = [p for p in plans if _uses_axes(p)]
    # measured collective time: none where a plan has no collective (pipelined stages
    # of one device each talk by point-to-point transfers, timed as waits)
    talking = [p for p in two if p["measured"]["comm_s"] > 0]

    def line(label, sel, fn):
        return f"| {label} | {_med([fn(p) for p in sel]):.1%} |" if sel else f"| {label} | - |"

    comp_cpu = lambda p: _err(p["estimate"]["compute_s"], p["measured"]["compute_cpu_s"])  # noqa: E731
    plus = lambda p: _err(  # noqa: E731
        p["estimate"]["memory_bytes"] + p["estimate"]["state_bytes"], p["measured"]["memory_bytes"]
    )
    summary = [
        "| median abs. relative error | value |",
        "|---|---:|",
        line(f"step time, all {len(plans)} plans", plans, lambda p: p["time_rel_error"]),
        line(f"step time, {len(one)} plans on 1 device", one, lambda p: p["time_rel_error"]),
        line(f"step time, {len(two)} plans on 2 devices", two, lambda p: p["time_rel_error"]),
        line(f"step time, estimates scaled by the host's speed, {len(_hosted(plans))} plans",
             _hosted(plans), lambda p: p["time_rel_error_host_corrected"]),
        line("compute term (vs segment time), all", plans, lambda p: p["compute_rel_error"]),
        line("compute term, 1 device", one, lambda p: p["compute_rel_error"]),
        line("compute term, 2 devices", two, lambda p: p["compute_rel_error"]),
        line(f"compute term, 2 devices, {len(_on_link(two, False))} plans on their own"
             " memory links", _on_link(two, False), lambda p: p["compute_rel_error"]),
        line(f"compute term, 2 devices, {len(_on_link(two, True))} plans on a shared"
             " memory link", _on_link(two, True), lambda p: p["compute_rel_error"]),
        line("compute term vs segment CPU time, 1 device", one, comp_cpu),
        line("compute term vs segment CPU time, 2 devices", two, comp_cpu),
        line(f"comm: model vs measured, {len(talking)} plans with collectives", talking,
             lambda p: _err(p["estimate"]["comm_s"], p["measured"]["comm_s"])),
        line("comm: emitted graph at calibrated link vs measured", talking,
             lambda p: _err(p["estimate"]["graph_comm_s"], p["measured"]["comm_s"])),
        line("comm: model vs emitted graph at calibrated link", two,
             lambda p: _err(p["estimate"]["comm_s"], p["estimate"]["graph_comm_s"])),
        line("memory: search estimate, all", plans, lambda p: p["memory_rel_error"]),
        line(f"step time, {len(axes)} plans with a memory axis (ZeRO, recompute, micro)",
             axes, lambda p: p["time_rel_error"]),
        line(f"memory, {len(axes)} plans with a memory axis", axes,
             lambda p: p["memory_rel_error"]),
        line("memory: estimate + state shards (the __new outputs)", plans, plus),
        line("memory: static liveness peak", plans, lambda p: p["liveness_rel_error"]),
    ]  # fmt: skip
    if plans:
        worst = max(plans, key=lambda p: abs(p["time_rel_error"]))
        summary.append(
            f"| step time, worst ({worst['model']}, {worst['devices']} device(s), point "
            f"{worst['point']}) | {abs(worst['time_rel_error']):.1%} |"
        )
    hosted = _hosted(plans)
    if hosted:
        worst = max(hosted, key=lambda p: abs(p["time_rel_error_host_corrected"]))
        ratios = [p["measured"]["host_speed_ratio"] for p in hosted]
        summary += [
            f"| step time scaled by the host's speed, worst ({worst['model']}, "
            f"{worst['devices']} device(s), point {worst['point']}) | "
            f"{abs(worst['time_rel_error_host_corrected']):.1%} |",
            f"| host: reference time over calibrated, median (range) | "
            f"x{statistics.median(ratios):.2f} (x{min(ratios):.2f}..x{max(ratios):.2f}) |",
        ]
    summary += ["", *one_sided(plans)]
    return rows, summary


def one_sided(plans: list[dict]) -> list[str]:
    """Per model and device count: the signed median step-time error (an error of one
    sign across a model's plans is a bias of the model, not noise), and the median
    absolute step-time and memory errors."""
    out = [
        "| model | devices | plans | signed median step-time error | range | scaled by the"
        " host's speed | median step-time error | median memory error |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    groups: dict[tuple[str, int], list[dict]] = {}
    for p in plans:
        groups.setdefault((p["model"], p["devices"]), []).append(p)
    for (model, devices), group in sorted(groups.items()):
        errs = [p["time_rel_error"] for p in group]
        hosted = [p["time_rel_error_host_corrected"] for p in _hosted(group)]
        scaled = f"{statistics.median(hosted):+.1%}" if hosted else "-"
        out.append(
            f"| {model} | {devices} | {len(errs)} | {statistics.median(errs):+.1%} "
            f"| {min(errs):+.0%}..{max(errs):+.0%} | {scaled} | {_med(errs):.1%} "
            f"| {_med([p['memory_rel_error'] for p in group]):.1%} |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", help="a calibrated profile (default: calibrate now)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--points", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--axes",
        help="the search's axes (search --axes; default split, with --pipelined split,stages)",
    )
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"))
    parser.add_argument(
        "--pipelined",
        action="store_true",
        help="the pipelined problems' own frontiers at 2 devices (validate --pipelined)",
    )
    parser.add_argument(
        "--write", action="store_true", help=f"replace the latest run in {RESULTS.name}"
    )
    args = parser.parse_args()
    if args.axes is None:
        args.axes = "split,stages" if args.pipelined else "split"
    if args.pipelined and "stages" not in args.axes.split(","):
        parser.error("--pipelined needs the stages axis in --axes")
    with tempfile.TemporaryDirectory(prefix="bench-validate-") as tmp_name:
        tmp = Path(tmp_name)
        cluster = Path(args.cluster) if args.cluster else tmp / "here.json"
        load_start = os.getloadavg()[0]
        if not args.cluster:
            calibrate(cluster)
        profile = json.loads(cluster.read_text())
        plans = []
        for model in args.models.split(","):
            plans += validate(model, cluster, tmp, args)["results"]
            print(f"{model}: {sum(p['model'] == model for p in plans)} plans", flush=True)
    rows, summary = rows_and_summary(plans)
    load_end = os.getloadavg()[0]
    cal = profile["calibration"]
    flag = " --cluster CLUSTER.json" if args.cluster else ""  # no machine paths in RESULTS
    if args.models != ",".join(MODELS):
        flag += f" --models {args.models}"
    if args.axes != "split":
        flag += f" --axes {args.axes} --optimizer {args.optimizer}"
    if args.pipelined:
        flag += " --pipelined"
    head = (
        f"`python benchmarks/bench_validate.py{flag}"
        f" --points {args.points} --steps {args.steps} --rounds {args.rounds}` -- "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.machine()}, {os.cpu_count()} cores "
        f"({profile['machine']['cpu']}), Python {platform.python_version()}, load average "
        f"{load_start:.1f} at the start and {load_end:.1f} at the end. Profile calibrated "
        f"{cal['date']} ({cal['backend']}, {cal['ranks']} ranks x {cal['threads_per_rank']} "
        f"thread, {cal['repeats']} repeats). Models: {args.models}; {len(plans)} plans; "
        f"{args.steps} steps per run, medians after {args.warmup} warm-up steps, the "
        f"median of {args.rounds} rounds over all plans; mpi backend"
        + ("; the pipelined problems' own frontiers at 2 devices." if args.pipelined else ".")
    )
    text = "\n".join([head, "", *summary, "", *rows, ""])
    print(text)
    if args.write and args.pipelined:
        write_section(PIPELINE_SECTION, f"{PIPELINE_SUBSECTION}\n\n{text}", PIPELINE_SUBSECTION)
    elif args.write:  # a run with memory axes keeps its own subsection
        sub = SUBSECTION if args.axes == "split" else AXES_SUBSECTION
        write_section(SECTION, f"{sub}\n\n{text}", sub)


if __name__ == "__main__":
    main()
