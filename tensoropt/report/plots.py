"""The report's figures (matplotlib, Agg backend, small PNGs).

Each function takes analysis data and a path and writes one PNG. matplotlib is imported
when a figure is drawn, never at import time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

from tensoropt.report.analysis import GIB, Point, Reference
from tensoropt.report.strategies import Track, kind_order

DPI = 100
# reference plan -> (marker, legend label, the marker's shape in words)
_MARKERS = {
    "data-parallel": ("s", "data-parallel", "squares"),
    "megatron": ("^", "Megatron", "triangles"),
    "fsdp": ("D", "FSDP (ZeRO-3 + recompute)", "diamonds"),
    "megatron+recompute": ("v", "Megatron + recompute", "down triangles"),
    "megatron+pp": ("d", "Megatron + pipeline stages", "thin diamonds"),
}


def reference_key(names) -> str:
    """What the frontier figure's open markers are, for the reference plans ``names``
    that it draws: "open squares: data-parallel; open triangles: Megatron"."""
    return "; ".join(
        f"open {shape}: {label}" for name, (_, label, shape) in _MARKERS.items() if name in names
    )


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def memory_scale(values: Sequence[float]) -> tuple[float, str]:
    """(bytes per unit, unit name) for an axis of memory values."""
    top = max(values, default=0.0)
    if top >= GIB:
        return float(GIB), "GiB"
    if top >= 2**20:
        return float(2**20), "MiB"
    return 1024.0, "KiB"


def _spread(values: Sequence[float]) -> float:
    positive = [v for v in values if v > 0]
    return max(positive) / min(positive) if positive else 1.0


def _plain(axis) -> None:
    """Tick labels like ``2`` and ``300`` instead of ``2x10^0`` on a log axis."""
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if _mantissa(v) in (2, 5) else ""))


def _mantissa(v: float) -> int:
    return round(v / 10 ** math.floor(math.log10(v))) if v > 0 else 0


def _log_if_spread(ax, xs: Sequence[float], ys: Sequence[float]) -> None:
    if _spread(xs) > 10:
        ax.set_xscale("log")
        _plain(ax.xaxis)
    if _spread(ys) > 10:
        ax.set_yscale("log")
        _plain(ax.yaxis)


def _save(fig, path: Path | BinaryIO) -> None:
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=DPI)
    _pyplot().close(fig)


def _legend(ax, **kwargs) -> None:
    """The legend right of the axes: inside, it covers lines that reach the corners
    (a staircase runs to the right edge, the largest device count along the top)."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
              **kwargs)  # fmt: skip


def devices_label(d: int) -> str:
    return f"{d} device" if d == 1 else f"{d} devices"


# Markers of the device counts' staircases: none of the reference plans' markers.
_COUNT_MARKERS = ("o", "P", "X", "*", "h", "p", "<", ">", "8", "H")


# What a point uses besides the split (its problem's variant), when the memory axes or
# the stages were searched: one filled marker per kind, in its device count's colour
# (the reference plans' markers are open and larger; a hexagon beside the circle was
# not told apart at this size, so the pipelined points take a filled square).
_USES_MARKERS = {
    (): ("o", "split only"),
    ("zero",): ("P", "ZeRO"),
    ("recompute",): ("X", "recompute"),
    ("zero", "recompute"): ("*", "ZeRO + recompute"),
    ("micro",): ("<", "micro-batches"),
    ("zero", "micro"): (">", "ZeRO + micro-batches"),
    ("recompute", "micro"): ("h", "recompute + micro-batches"),
    ("zero", "recompute", "micro"): ("p", "ZeRO + recompute + micro-batches"),
    ("stages",): ("s", "pipeline stages"),
}


def uses_of(variant) -> tuple[str, ...]:
    """The key of :data:`_USES_MARKERS` for a point's problem variant: the axes it uses
    besides the split (any pipelined point is ``("stages",)``)."""
    if variant.stages > 1:
        return ("stages",)
    used = (
        ("zero", bool(variant.zero)),
        ("recompute", variant.recompute),
        ("micro", variant.micro_batches > 1),
    )
    return tuple(name for name, on in used if on)


def frontier(
    rows: Mapping[int, Sequence[Point]],
    refs: Mapping[int, Sequence[Reference]],
    path: Path | BinaryIO,
    title: str,
    budget: float | None = None,
) -> None:
    """Memory per device against step time, one staircase per device count, with the
    reference plans of each count marked in its colour (at their own memory, in the
    axis' unit) and, with ``budget``, the memory budget as a dashed line.

    Staircases are drawn from the most points to the fewest, each above the previous
    one, and a count with a single point gets a larger marker: a short frontier stays
    visible where a longer one passes through the same place. A reference marker's
    artist is labelled ``_NAME at D devices`` (the underscore keeps it out of the
    legend), so that it can be found and checked against the search's figures.

    When some point uses a memory axis or pipeline stages, the staircases have no
    markers of their own: each point gets the filled marker of what it uses
    (:data:`_USES_MARKERS`, named in the legend) in its count's colour, one artist per
    (count, kind) labelled ``_uses KIND of count D``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9.0, 4.8))
    mems = [p.memory_bytes for ps in rows.values() for p in ps]
    mems += [r.memory_bytes for rs in refs.values() for r in rs]
    times = [p.time_s for ps in rows.values() for p in ps]
    times += [r.time_s for rs in refs.values() for r in rs]
    scale, unit = memory_scale(mems)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    order = sorted(rows, key=lambda d: -len(rows[d]))
    by_uses = any(uses_of(p.variant) for ps in rows.values() for p in ps)
    drawn_uses: set[tuple[str, ...]] = set()
    for k, d in enumerate(rows):
        points = rows[d]
        c = colors[k % len(colors)]
        if points:  # none when nothing fits the memory budget at this count
            xs = [p.time_s * 1e3 for p in points]
            ys = [p.memory_bytes / scale for p in points]
            z = 2 + order.index(d) / max(len(order), 1)
            ms = 7 if len(points) == 1 else 3
            ax.step(
                xs,
                ys,
                where="post",
                color=c,
                label=devices_label(d),
                marker=None if by_uses else _COUNT_MARKERS[k % len(_COUNT_MARKERS)],
                ms=ms,
                lw=1.2,
                zorder=z,
            )
            if by_uses:
                kinds: dict[tuple[str, ...], list[int]] = {}
                for i, p in enumerate(points):
                    kinds.setdefault(uses_of(p.variant), []).append(i)
                for uses, at in kinds.items():
                    marker, name = _USES_MARKERS[uses]
                    ax.plot([xs[i] for i in at], [ys[i] for i in at], ls="none",
                            marker=marker, ms=ms + 2, color=c, zorder=z,
                            label=f"_uses {name} of count {d}")  # fmt: skip
                drawn_uses.update(kinds)
        for r in refs.get(d, ()):
            marker, _, _ = _MARKERS[r.name]
            ax.scatter(
                [r.time_s * 1e3],
                [r.memory_bytes / scale],
                marker=marker,
                s=50,
                facecolors="none",
                edgecolors=c,
                zorder=4,
                label=f"_{r.name} at {devices_label(d)}",
            )
    shown = {r.name for rs in refs.values() for r in rs}  # the legend names what is drawn
    for name, (marker, label, _) in _MARKERS.items():
        if name in shown:
            ax.scatter([], [], marker=marker, facecolors="none", edgecolors="k", label=label)
    for uses, (marker, label) in _USES_MARKERS.items():
        if uses in drawn_uses:
            ax.plot([], [], ls="none", marker=marker, ms=6, color="k", label=f"uses {label}")
    if budget is not None:
        ax.axhline(budget / scale, color="0.3", ls="--", lw=1.0, label="memory budget")
        mems.append(budget)
    _log_if_spread(ax, times, mems)
    ax.set_xlabel("estimated step time (ms)")
    ax.set_ylabel(f"memory per device ({unit})")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    _legend(ax)
    _save(fig, path)


def capacity(
    steps: Sequence[Point],
    rows: Mapping[int, Sequence[Point]],
    marks: Sequence[float],
    path: Path,
    title: str,
) -> None:
    """Best step time against memory capacity per device: the best over all device
    counts (black staircase, dots coloured by the device count that reaches each step)
    and, thin, the best at each device count alone."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9.0, 4.4))
    mems = [p.memory_bytes for ps in rows.values() for p in ps]
    # the axis covers the model's range: beyond the fastest plan more memory buys nothing
    top = max(mems, default=1.0) * 1.6
    scale, unit = memory_scale(mems)
    counts = sorted(rows)
    cmap = plt.get_cmap("viridis", max(len(counts), 2))
    color = {d: cmap(i) for i, d in enumerate(counts)}
    for d, points in rows.items():
        ordered = sorted(points, key=lambda p: p.memory_bytes)
        xs = [p.memory_bytes / scale for p in ordered] + [top / scale]
        ys = [p.time_s * 1e3 for p in ordered]
        ax.step(xs, [*ys, ys[-1]], where="post", color=color[d], lw=0.8, alpha=0.6)
    xs = [p.memory_bytes / scale for p in steps] + [top / scale]
    ys = [p.time_s * 1e3 for p in steps]
    ax.step(xs, [*ys, ys[-1]], where="post", color="black", lw=1.6, label="best of all")
    for d in counts:
        pts = [p for p in steps if p.devices == d]
        ax.scatter(
            [p.memory_bytes / scale for p in pts],
            [p.time_s * 1e3 for p in pts],
            color=color[d],
            edgecolors="black",
            linewidths=0.5,
            s=24,
            zorder=3,
            label=devices_label(d),
        )
    for m in marks:
        if min(mems, default=0) <= m <= top:
            ax.axvline(m / scale, color="0.6", lw=0.8, ls="--", zorder=0)
    _log_if_spread(
        ax,
        [*xs, *(m / scale for m in mems)],
        ys + [p.time_s * 1e3 for ps in rows.values() for p in ps],
    )
    ax.set_xlabel(f"memory capacity per device ({unit})")
    ax.set_ylabel("best step time (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    _legend(ax, title="devices (thin: that count alone)", title_fontsize=7)
    _save(fig, path)


def fewest_devices(curves: Mapping[str, Sequence[Point]], path: Path, title: str) -> None:
    """Fewest devices against step-time target: one staircase per memory capacity.

    A curve's points are (fastest time at d devices, d) where d beats every smaller
    count; for any target between two such times the fewer-device point's count holds.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9.0, 4.2))
    times = [p.time_s for pts in curves.values() for p in pts]
    right = max(times, default=1.0) * 1.5 * 1e3
    for label, pts in curves.items():
        if not pts:
            continue
        xs = [p.time_s * 1e3 for p in reversed(pts)] + [right]
        ys = [p.devices for p in reversed(pts)]
        ys = [*ys, ys[-1]]
        ax.step(xs, ys, where="post", label=label, marker="o", ms=3, lw=1.2)
    _log_if_spread(ax, times, [])
    counts = sorted({p.devices for pts in curves.values() for p in pts})
    if counts and counts[-1] > 2 * max(counts[0], 1):
        ax.set_yscale("log", base=2)
    ax.set_yticks(counts)
    ax.set_yticklabels([str(d) for d in counts])
    from matplotlib.ticker import NullLocator

    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("step-time target (ms)")
    ax.set_ylabel("fewest devices")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    _legend(ax, title="memory per device", title_fontsize=7)
    _save(fig, path)


def heatmap(tr: Track, columns: Sequence[int], path: Path, title: str, unit_scale) -> None:
    """Kind of every weight unit (rows, graph order) at frontier points (columns, from
    fastest to least memory)."""
    import numpy as np

    plt = _pyplot()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    kinds = sorted({tr.kinds[u][i] for u in range(len(tr.units)) for i in columns}, key=kind_order)
    code = {k: n for n, k in enumerate(kinds)}
    grid = np.array([[code[tr.kinds[u][i]] for i in columns] for u in range(len(tr.units))])
    colors = kind_colors(kinds)
    cmap = ListedColormap([colors[k] for k in kinds])
    height = min(7.0, 2.5 + 0.02 * len(tr.units))
    fig, ax = plt.subplots(figsize=(8.0, height))
    ax.imshow(
        grid, aspect="auto", interpolation="nearest", cmap=cmap, vmin=-0.5, vmax=len(kinds) - 0.5
    )
    step = max(1, len(columns) // 8)
    ticks = list(range(0, len(columns), step))
    scale, unit = unit_scale
    ax.set_xticks(ticks)
    ax.set_xticklabels(
        [f"{tr.points[columns[t]].memory_bytes / scale:.3g}" for t in ticks], fontsize=7
    )
    ax.set_xlabel(
        f"frontier point, fastest (left) to least memory (right): memory per device ({unit})"
    )
    rows = _row_ticks(tr)
    ax.set_yticks([r for r, _ in rows])
    ax.set_yticklabels([label for _, label in rows], fontsize=6)
    ax.set_ylabel("weight units, graph order")
    ax.set_title(title, fontsize=10)
    handles = [Patch(color=colors[k], label=k) for k in kinds]
    _legend(ax, handles=handles)
    _save(fig, path)


def kind_colors(kinds: Sequence[str]) -> dict[str, tuple]:
    """Grey for replicated, blues for data parallel, reds for tensor parallel, purples for
    both; darker for higher degrees, lighter where devices repeat a shard."""
    plt = _pyplot()
    families = {"replicated": "Greys", "dp": "Blues", "tp": "Reds", "tp x dp": "Purples"}
    by_family: dict[str, list[str]] = {}
    for k in kinds:
        head = k.split(",")[0]
        family = (
            "replicated"
            if head == "replicated"
            else (
                "tp x dp" if "tp=" in head and "dp=" in head else ("tp" if "tp=" in head else "dp")
            )
        )
        by_family.setdefault(family, []).append(k)
    out = {}
    for family, members in by_family.items():
        cmap = plt.get_cmap(families[family])
        for n, k in enumerate(members):
            shade = 0.3 if family == "replicated" else 0.35 + 0.55 * (n + 1) / len(members)
            if "redundant" in k:
                shade *= 0.75
            out[k] = cmap(shade)
    return out


def _row_ticks(tr: Track, limit: int = 24) -> list[tuple[int, str]]:
    """Every unit's name when few, else the first unit of each layer (leading name
    component), at most ``limit`` labels."""
    if len(tr.units) <= 40:
        return [(u, row.name.removesuffix("/" + row.op)) for u, row in enumerate(tr.units)]
    firsts: list[tuple[int, str]] = []
    seen = set()
    for u, row in enumerate(tr.units):
        head = row.name.split("/")[0]
        if head not in seen:
            seen.add(head)
            firsts.append((u, head))
    if len(firsts) > limit:
        stride = math.ceil(len(firsts) / limit)
        firsts = firsts[::stride]
    return firsts
