"""The report's markdown: every number comes from analysis data, every sentence from it too."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tensoropt.cost.cluster import ClusterProfile
from tensoropt.report.analysis import (
    AXIS_LEVELS,
    AxisRow,
    BaselineRow,
    CapacityRow,
    Point,
    Reference,
    TargetRow,
    sample_indices,
)
from tensoropt.report.strategies import GroupChange, Track, layer_ranges
from tensoropt.search.merge import fewer_devices, fewer_note


@dataclass(frozen=True, slots=True)
class Header:
    """What the report says about its input and how it was searched."""

    model: str  # display name (zoo name and preset, or the file name)
    model_path: str
    params: int
    batch: int
    optimizer: str
    devices: tuple[int, ...]
    mesh_spec: str
    meshes: int  # (devices, mesh) problems solved
    epsilon: float | None
    memory_budget: float | None
    guarantee: str
    seconds: float
    axes: str | None = None  # the axes searched and those left out (`search`'s axes line)
    # how far the profile's estimates are typically off, and the memory-link case they
    # assume (cost.accuracy); None for a built-in profile
    estimates: str | None = None


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def fmt_mem(b: float) -> str:
    if math.isinf(b):
        return "any"
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


def fmt_count(n: float) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def _points(n: int) -> str:
    return f"{n} frontier point{'s' if n != 1 else ''}"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return lines


def header(h: Header, profile: ClusterProfile) -> list[str]:
    intra, inter = profile.intra, profile.inter
    budget = fmt_mem(h.memory_budget) if h.memory_budget is not None else "none"
    mode = f"epsilon = {h.epsilon}" if h.epsilon is not None else "exact"
    return [
        f"# Parallelization trade-offs: {h.model} on {profile.name}",
        "",
        "All times and memories are the cost model's estimates (roofline compute, "
        "alpha-beta communication, additive memory), not measurements.",
        "",
        f"- **Model**: {h.model} (`{h.model_path}`), {fmt_count(h.params)} trained parameters, "
        f"batch {h.batch} per step, optimizer {h.optimizer}.",
        f"- **Cluster** `{profile.name}`: {profile.description}. "
        f"{fmt_flops(profile.peak_flops)} peak at {profile.efficiency:.0%} efficiency, "
        f"{profile.memory_bandwidth / 1e9:.0f} GB/s memory, {fmt_mem(profile.memory_bytes)} per "
        f"device, {profile.devices_per_node} devices per node; intra-node "
        f"{intra.bandwidth / 1e9:.4g} GB/s ({intra.alpha_s * 1e6:.3g} µs), inter-node "
        f"{inter.bandwidth / 1e9:.4g} GB/s ({inter.alpha_s * 1e6:.3g} µs).",
        f"- **Search**: devices {', '.join(map(str, h.devices))}; mesh {h.mesh_spec} "
        f"({h.meshes} mesh problems); {mode}; memory budget {budget}.",
        f"- **Guarantee**: {h.guarantee}",
        *([f"- **Axes**: {h.axes}."] if h.axes else []),
        *([f"- **Estimates**: {h.estimates}."] if h.estimates else []),
        f"- **Time taken**: {h.seconds:.1f} s.",
        "",
    ]


def fmt_flops(rate: float) -> str:
    """A FLOP/s rate in the unit that keeps three figures: a CPU's 92.5 GFLOP/s, not
    '0 TFLOP/s'."""
    for scale, unit in ((1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s")):
        if rate >= scale:
            return f"{rate / scale:.3g} {unit}"
    return f"{rate / 1e6:.3g} MFLOP/s"


def frontier_section(
    rows: Mapping[int, Sequence[Point]],
    batch: int,
    png: str,
    per_count: int = 5,
    references: Sequence[str] = ("data-parallel", "megatron"),
) -> list[str]:
    """Section 1; ``references``: the reference plans the figure marks."""
    from tensoropt.report.plots import reference_key

    total = sum(len(ps) for ps in rows.values())
    key = reference_key(references)
    key = (
        f" {key[0].upper()}{key[1:]} (the best mesh of each device count, same colour)."
        if key
        else ""
    )
    out = [
        "## 1. The frontier per device count",
        "",
        f"Memory per device against step time, {total} frontier points over "
        f"{len(rows)} device counts.{key}",
        "",
        f"![frontier per device count]({png})",
        "",
    ]
    fewer = fewer_devices(
        {d: [(p.time_s, p.memory_bytes) for p in points] for d, points in rows.items()}
    )
    matched = False
    for d, points in rows.items():
        out.append(f"**{d} device{'s' if d > 1 else ''}**: {_points(len(points))}.")
        out.append("")
        body = []
        for i in sample_indices(len(points), per_count):
            p = points[i]
            role = "fastest" if i == 0 else ("least memory" if i == len(points) - 1 else "")
            plan = p.summary
            note = fewer_note(fewer(d, p.time_s, p.memory_bytes), plan)
            plan += note
            matched = matched or bool(note)
            body.append(
                [
                    str(i),
                    role,
                    p.mesh_text,
                    fmt_time(p.time_s),
                    fmt_mem(p.memory_bytes),
                    f"{batch / p.time_s:.4g}",
                    plan,
                ]
            )
        out += _table(["#", "", "mesh", "step time", "memory/device", "samples/s", "plan"], body)
        out.append("")
    if matched:
        out += [
            "No better than N devices: a plan on fewer devices, N, is as fast with no more "
            "memory per device.",
            "",
        ]
    return out


def capacity_section(rows: Sequence[CapacityRow], steps: Sequence[Point], png: str) -> list[str]:
    out = [
        "## 2. The fastest plan for each memory capacity",
        "",
        "For a device memory capacity, the fastest plan over every device count searched "
        f"whose memory per device fits. The black curve (best of all counts) steps down "
        f"{len(steps)} times; thin curves are each device count alone; dashed lines mark "
        "the capacities of the table.",
        "",
        f"![best step time per memory capacity]({png})",
        "",
    ]
    body = []
    for r in rows:
        if r.best is None:
            body.append([fmt_mem(r.capacity), "does not fit", "", "", "", "", ""])
            continue
        few = r.fewest
        fewest = f"{few.devices} ({fmt_time(few.time_s)})" if few else ""
        body.append(
            [
                fmt_mem(r.capacity),
                fmt_time(r.best.time_s),
                str(r.best.devices),
                r.best.mesh_text,
                fmt_mem(r.best.memory_bytes),
                fewest,
                r.best.summary,
            ]
        )
    head = [
        "capacity",
        "best step time",
        "devices",
        "mesh",
        "memory used",
        "fewest devices that fit (time)",
        "plan",
    ]
    return [*out, *_table(head, body), ""]


def target_section(rows: Sequence[TargetRow], caps: Sequence[float], png: str) -> list[str]:
    out = [
        "## 3. The fewest devices for each step-time target",
        "",
        "For a step-time target, the fewest devices with a plan that reaches it, without a "
        "memory limit and within each listed capacity per device (cell: devices, mesh).",
        "",
        f"![fewest devices per step-time target]({png})",
        "",
    ]
    head = ["step-time target", *(f"≤ {fmt_mem(c)}" for c in caps), "any memory"]
    body = []
    for r in rows:
        cells = [f"{p.devices} ({p.mesh_text})" if p else "none" for p in r.by_capacity]
        body.append([fmt_time(r.target_s), *cells])
    return [*out, *_table(head, body), ""]


def _kinds_list(kinds: Sequence[str]) -> str:
    return ", ".join(dict.fromkeys(kinds))


def _at(tr: Track, i: int) -> str:
    p = tr.points[i]
    return f"point {i} ({fmt_mem(p.memory_bytes)}, {fmt_time(p.time_s)})"


def _group_line(tr: Track, g: GroupChange) -> str:
    size = f"{len(g.units)} units" if len(g.units) > 1 else "1 unit"
    if g.changed:
        if len(g.units) == 1:
            which = "1 unit changes"
        elif len(g.changed) == len(g.units):
            which = f"all {size} change"
        else:
            ranges = layer_ranges(g.changed)
            which = f"{len(g.changed)} of {size} change" + (f": {ranges}" if ranges else "")
        text = (
            f"- `{g.role}` ({g.ops}; {which}): {g.fast_state} → {g.lean_state}; "
            f"first moves at {_at(tr, g.first_point)}, settled from {_at(tr, g.settle_point)}"
        )
        if g.detours:
            text += f"; {g.detours} more units detour and come back"
        return text + "."
    return (
        f"- `{g.role}` ({g.ops}, {size}): {g.fast_state} at both ends; {g.detours} units "
        f"take other strategies in between, from {_at(tr, g.first_point)}."
    )


# what a point's variant uses of each memory axis and of pipeline stages, in the order
# the search adds them (search.driver.axis_level)
_AXIS_USES = (
    ("ZeRO", lambda v: v.zero > 0),
    ("recomputation", lambda v: v.recompute),
    ("micro-batches", lambda v: v.micro_batches > 1),
    ("pipeline stages", lambda v: v.stages > 1),
)


def axes_sentence(tr: Track) -> str | None:
    """Where along the frontier each memory axis (and pipelining) first appears and how
    many points use it; None when no point uses one."""
    parts = []
    for name, used in _AXIS_USES:
        found = [i for i, p in enumerate(tr.points) if used(p.variant)]
        if found:
            parts.append(f"{name} from {_at(tr, found[0])} on, in {len(found)}")
    if not parts:
        return None
    return "The memory axes along it (points fastest first): " + "; ".join(parts) + "."


def change_sentences(tr: Track, changes: Sequence[GroupChange], limit: int = 10) -> list[str]:
    """Sentences saying which units change strategy where along the frontier, and where
    the memory axes come in."""
    first, last = tr.points[0], tr.points[-1]
    lines = [
        f"On {tr.devices} devices the frontier has {_points(len(tr.points))}, from "
        f"{fmt_mem(first.memory_bytes)} at {fmt_time(first.time_s)} (fastest) to "
        f"{fmt_mem(last.memory_bytes)} at {fmt_time(last.time_s)} (least memory); "
        f"{len(tr.units)} weight units."
    ]
    axes = axes_sentence(tr)
    if axes is not None:
        lines.append(axes)
    moving = [g for g in changes if g.first_point >= 0]
    still = [g for g in changes if g.first_point < 0]
    if not moving:
        kinds = ", ".join(dict.fromkeys(g.fast_state for g in changes))
        lines.append(f"No weight unit changes strategy along this frontier ({kinds}).")
        return lines
    settled = [g for g in moving if g.changed]
    if settled:
        order = [f"`{g.role}` ({g.fast_state} → {g.lean_state})" for g in settled[:4]]
        lines.append(
            f"As memory tightens from {fmt_mem(first.memory_bytes)} to "
            f"{fmt_mem(last.memory_bytes)}, the groups settle into their least-memory "
            "strategy in this order: " + ", then ".join(order) + "."
        )
    lines.append("")
    lines += [_group_line(tr, g) for g in moving[:limit]]
    if len(moving) > limit:
        lines.append(f"- and {len(moving) - limit} more groups change.")
    if still:
        kept = ", ".join(f"`{g.role}` ({g.ops}: {g.fast_state})" for g in still[:8])
        more = f" and {len(still) - 8} more groups" if len(still) > 8 else ""
        lines.append(f"- unchanged along the whole frontier: {kept}{more}.")
    return lines


def strategy_section(blocks: Sequence[tuple[Track, Sequence[GroupChange], str, int]]) -> list[str]:
    out = [
        "## 4. How the strategies change along the frontier",
        "",
        "Each weight unit (one forward op that reads parameters, with its backward and "
        "update) at frontier points from the fastest (left) to the least memory (right). "
        "`dp=N`: the op's work is split N ways with replicated weights (gradients "
        "all-reduced); `tp=N`: its weights are sharded N ways; `replicated`: every device "
        "does all of it; `k x redundant`: that many devices repeat the same shard.",
        "",
    ]
    for tr, changes, png, shown in blocks:
        note = f" ({shown} of {len(tr.points)} points shown)" if shown < len(tr.points) else ""
        out += [
            f"### {tr.devices} devices",
            "",
            f"![strategies at {tr.devices} devices{note}]({png})",
            "",
        ]
        out += change_sentences(tr, changes)
        out.append("")
    return out


def baseline_section(
    rows: Sequence[BaselineRow], batch: int, gaps: Mapping[int, Mapping[str, str]] | None = None
) -> list[str]:
    """Section 5; ``gaps``: per device count, the references no mesh holds and why."""
    out = [
        "## 5. Reference plans against the frontier",
        "",
        "Reference plans evaluated on the same cost model, each on its fastest mesh: data "
        "parallel, Megatron, and with the memory axes FSDP (data parallel, ZeRO-3 and every "
        "block recomputed) and Megatron with every block recomputed. "
        "Speed-up: reference time / fastest frontier time. Memory saving: reference memory / "
        "least memory of a frontier plan at most as slow as the reference.",
        "",
    ]
    body = []
    best_speed: tuple[float, str] = (0.0, "")
    best_save: tuple[float, str] = (0.0, "")
    degenerate = []
    for r in rows:
        for ref, lean in zip(r.references, r.lean_at_reference_time, strict=True):
            speed = ref.time_s / r.fastest.time_s
            save = ref.memory_bytes / lean.memory_bytes
            name = _ref_name(ref)
            if ref.name == "data-parallel" and batch % r.devices:
                degenerate.append(r.devices)
                name += " *"
            else:
                label = f"{_ref_name(ref)} at {r.devices} devices"
                best_speed = max(best_speed, (speed, label))
                best_save = max(best_save, (save, label))
            body.append(
                [
                    str(r.devices),
                    name,
                    "x".join(map(str, ref.mesh)),
                    fmt_time(ref.time_s),
                    fmt_mem(ref.memory_bytes),
                    fmt_time(r.fastest.time_s),
                    f"{speed:.2f}x",
                    fmt_mem(lean.memory_bytes),
                    f"{save:.2f}x",
                    fmt_mem(r.leanest.memory_bytes),
                ]
            )
    missing = [
        f"- {d} devices, {_ref_name_of(name)}: {reason}."
        for d, found in sorted((gaps or {}).items())
        for name, reason in found.items()
    ]
    if missing:
        missing = ["Not expressible on any searched mesh of its device count:", "", *missing, ""]
    if not body:
        return [*out, "No reference plan is expressible on the searched meshes.", "", *missing]
    head = [
        "devices",
        "reference",
        "mesh",
        "step time",
        "memory",
        "frontier fastest",
        "speed-up",
        "frontier memory at ≤ reference time",
        "saving",
        "frontier least memory",
    ]
    out += _table(head, body)
    out.append("")
    if degenerate:
        out += [
            f"\\* The batch of {batch} does not split over "
            f"{', '.join(map(str, degenerate))} devices, so the data-parallel plan there "
            "replicates the batch (every device runs the whole step) and is left out of the "
            "summary below.",
            "",
        ]
    if best_speed[1]:
        out += [
            f"Largest speed-up of the frontier over a reference: {best_speed[0]:.2f}x "
            f"({best_speed[1]}); largest memory saving at no loss of speed: "
            f"{best_save[0]:.2f}x ({best_save[1]}).",
            "",
        ]
    return [*out, *missing]


def _ref_name(ref: Reference) -> str:
    return _ref_name_of(ref.name)


def _ref_name_of(name: str) -> str:
    return {
        "data-parallel": "data parallel",
        "megatron": "Megatron",
        "fsdp": "FSDP (ZeRO-3 + recompute)",
        "megatron+recompute": "Megatron + recompute",
    }.get(name, name)


def axes_section(rows: Sequence[AxisRow]) -> list[str]:
    """What each memory axis buys: the least memory per device with the split alone and
    with each axis added, and the step time that plan takes."""
    out = [
        "## 6. What each memory axis buys",
        "",
        "Least memory per device with the split of every op alone, then adding ZeRO "
        "(optimizer state, gradients and parameters sharded over the data-parallel "
        "devices), recomputation of every block in the backward, micro-batches "
        "with gradient accumulation, and pipeline stages (each on its own devices); the "
        "step time of that plan in brackets. A dash: "
        "the axis was not searched (`search --axes`) or no plan of that level fits.",
        "",
    ]
    if not rows:
        return [*out, "No device count was searched.", ""]
    body = []
    gains = []
    for r in rows:
        cells = [str(r.devices)]
        for p in r.least:
            cells.append("-" if p is None else f"{fmt_mem(p.memory_bytes)} ({fmt_time(p.time_s)})")
        body.append(cells)
        first, last = r.least[0], next((p for p in reversed(r.least) if p is not None), None)
        if first is not None and last is not None and last.memory_bytes < first.memory_bytes:
            gains.append((first.memory_bytes / last.memory_bytes, r.devices, last))
    out += _table(["devices", *AXIS_LEVELS], body)
    out.append("")
    if gains:
        ratio, d, p = max(gains)
        out += [
            f"The memory axes cut the least memory per device by up to {ratio:.1f}x "
            f"(at {d} devices: {fmt_mem(p.memory_bytes)}, step {fmt_time(p.time_s)}, "
            f"{p.summary}).",
            "",
        ]
    pays = [
        (r.devices, r.least[-1], before)
        for r in rows
        if r.least[-1] is not None
        for before in [next((p for p in reversed(r.least[:-1]) if p is not None), None)]
        if before is None or r.least[-1].memory_bytes < before.memory_bytes
    ]
    if pays:
        d, p, before = pays[0]
        than = "" if before is None else f", against {fmt_mem(before.memory_bytes)} without"
        out += [
            f"Pipeline stages pay first at {d} devices: {fmt_mem(p.memory_bytes)} per "
            f"device{than} (step {fmt_time(p.time_s)}, {p.summary}).",
            "",
        ]
    return out
