"""Write a report directory (report.md + PNGs) from one exploration, all or nothing.

Everything is written into a fresh temporary sibling of the output directory, which
replaces the output directory only when every file is written (the same commit step as
``tensoropt compile``). Any failure removes the temporary directory and leaves an
existing report untouched.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from tensoropt.cost.cluster import ClusterProfile
from tensoropt.errors import OutputDirError, TensorOptError
from tensoropt.ir.files import mkdtemp_public
from tensoropt.report import analysis, plots, render, strategies
from tensoropt.search.driver import Exploration

log = logging.getLogger(__name__)

REPORT_FILE = "report.md"
FRONTIER_PNG = "frontier.png"
CAPACITY_PNG = "capacity.png"
DEVICES_PNG = "fewest-devices.png"


@dataclass(frozen=True, slots=True)
class ReportOptions:
    detail_devices: tuple[int, ...] = ()  # strategy sections; empty: 8 and the largest
    heatmap_points: int = 60  # frontier points per heatmap, evenly spaced
    table_rows: int = 5  # frontier points listed per device count


def strategy_png(devices: int) -> str:
    return f"strategies-{devices}.png"


def detail_counts(exp: Exploration, wanted: tuple[int, ...]) -> list[int]:
    """The device counts whose strategies are drawn (8 and the largest by default)."""
    counts = analysis.device_counts(exp)
    if wanted:
        missing = [d for d in wanted if d not in counts]
        if missing:
            raise TensorOptError(
                f"--detail-devices {','.join(map(str, missing))}: not among the searched "
                f"device counts {','.join(map(str, counts))}"
            )
        return sorted(set(wanted))
    return sorted({d for d in (8, counts[-1]) if d in counts})


def prepare_report_dir(outdir: str | os.PathLike) -> str:
    """A fresh temporary sibling of ``outdir``; refuses to replace a foreign directory."""
    outdir = os.path.abspath(outdir)
    parent = os.path.dirname(outdir)
    if not os.path.isdir(parent):
        raise OutputDirError(f"{outdir}: parent directory {parent} does not exist")
    if os.path.exists(outdir):
        if not os.path.isdir(outdir):
            raise OutputDirError(f"{outdir}: exists and is not a directory; choose another -o")
        entries = os.listdir(outdir)
        if entries and REPORT_FILE not in entries:
            raise OutputDirError(
                f"{outdir}: exists and is not a tensoropt report directory (no {REPORT_FILE}); "
                "choose another -o or remove it"
            )
    return mkdtemp_public(parent, prefix=".tensoropt-report-")


def write_report(
    exp: Exploration,
    head: render.Header,
    profile: ClusterProfile,
    outdir: str | os.PathLike,
    options: ReportOptions = ReportOptions(),
) -> list[str]:
    """Write ``outdir``/report.md and its figures; returns the file names written."""
    from tensoropt.passes.compile import commit_outdir

    if not exp.merged:
        raise TensorOptError("the search found no plan; nothing to report")
    details = detail_counts(exp, options.detail_devices)
    tmp = prepare_report_dir(outdir)
    try:
        names = _write_into(Path(tmp), exp, head, profile, options, details)
        commit_outdir(tmp, os.fspath(outdir))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return names


def _write_into(
    root: Path,
    exp: Exploration,
    head: render.Header,
    profile: ClusterProfile,
    options: ReportOptions,
    details: list[int],
) -> list[str]:
    title = f"{head.model} on {profile.name}"
    rows = analysis.device_frontiers(exp)
    refs = analysis.references(exp)
    lines = render.header(head, profile)

    plots.frontier(
        rows, refs, root / FRONTIER_PNG, f"Frontier per device count: {title}", exp.memory_budget
    )
    drawn = {r.name for rs in refs.values() for r in rs}
    lines += render.frontier_section(rows, head.batch, FRONTIER_PNG, options.table_rows, drawn)

    caps = analysis.capacities(exp)
    steps = analysis.capacity_steps(exp)
    plots.capacity(steps, rows, caps, root / CAPACITY_PNG, f"Best step time per capacity: {title}")
    lines += render.capacity_section(analysis.capacity_table(exp, caps), steps, CAPACITY_PNG)

    binding = analysis.binding_capacities(exp, caps, prefer=(profile.memory_bytes,))
    curves = {f"≤ {render.fmt_mem(c)}": analysis.device_steps(exp, c) for c in binding}
    curves["any"] = analysis.device_steps(exp)
    plots.fewest_devices(curves, root / DEVICES_PNG, f"Fewest devices per target: {title}")
    targets = analysis.time_targets(exp)
    lines += render.target_section(
        analysis.target_table(exp, targets, binding), binding, DEVICES_PNG
    )

    names = [REPORT_FILE, FRONTIER_PNG, CAPACITY_PNG, DEVICES_PNG]
    blocks = []
    for d in details:
        tr = strategies.track(exp, d, rows[d])
        columns = analysis.sample_indices(len(tr.points), options.heatmap_points)
        png = strategy_png(d)
        scale = plots.memory_scale([p.memory_bytes for p in tr.points])
        plots.heatmap(
            tr, columns, root / png, f"Strategies along the frontier: {title}, {d} devices", scale
        )
        blocks.append((tr, strategies.group_changes(tr), png, len(columns)))
        names.append(png)
    lines += render.strategy_section(blocks)
    lines += render.baseline_section(
        analysis.baselines(exp), head.batch, analysis.reference_gaps(exp)
    )
    lines += render.axes_section(analysis.axis_gains(exp))

    (root / REPORT_FILE).write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
    log.info("report written: %s", ", ".join(names))
    return names
