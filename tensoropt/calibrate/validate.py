"""Estimated against measured step time and memory of searched plans (``tensoropt validate``).

For each device count, a few frontier points (fastest, min-memory and evenly spaced
ones between) are compiled through the same passes as ``compile --pick`` and run
with ``--profile``. A plan's measured step time is the slowest rank's median step;
its measured memory the largest rank's (:mod:`tensoropt.runtime.profiling` defines
both). Relative error = (estimate - measured) / measured: positive means the cost
model over-estimates. The static-liveness peak of the emitted device graph
(:func:`tensoropt.passes.device_stats.device_stats`) is reported beside the search's
memory estimate.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from tensoropt.calibrate.memlink import LinkProbe
from tensoropt.runtime.profiling import ProfileReport

SCHEMA = "tensoropt.validate/1"


def select_points(count: int, k: int) -> list[int]:
    """Indices into a frontier of ``count`` points (fastest first): both ends, evenly between."""
    if count <= 0 or k <= 0:
        return []
    k = min(k, count)
    if k == 1:
        return [0]
    return sorted({round(i * (count - 1) / (k - 1)) for i in range(k)})


def rel_error(estimate: float, measured: float) -> float:
    return (estimate - measured) / measured if measured > 0 else float("inf")


@dataclass(frozen=True, slots=True)
class PlanCheck:
    """One compiled and measured frontier point."""

    devices: int
    mesh: tuple[int, ...]
    index: int  # in the per-device-count frontier, fastest first
    frontier_size: int
    summary: str
    est_time_s: float
    est_memory_bytes: float
    liveness_peak_bytes: int  # largest static liveness peak over the device graphs
    profile: ProfileReport
    est_compute_s: float  # the same plan costed with free communication
    state_bytes: int = 0  # largest rank's parameter + optimizer-state shards
    graph_comm_s: float = 0.0  # the emitted graph's collectives at the profile's link rates
    collectives: int = 0  # collectives per step in the emitted graph (largest rank)
    link: LinkProbe | None = None  # the host's memory link just before the run (memlink)
    # the memory axes the plan uses (search.driver.Variant.to_json); None: the split alone
    axes: dict | None = None
    # the host's reference time around the run over the calibration's (hostspeed; > 1:
    # the host ran slower than when calibrated); None: the profile has no reference
    host: float | None = None
    # every round's measured step time (the slowest rank's median), in run order; the
    # profile above is the median round's
    round_times_s: tuple[float, ...] = ()

    @property
    def measured_time_s(self) -> float:
        return max(r.step_s for r in self.profile.ranks)

    @property
    def measured_memory_bytes(self) -> float:
        return max(r.memory_bytes for r in self.profile.ranks)

    @property
    def measured_compute_s(self) -> float:
        return max(r.compute_s for r in self.profile.ranks)

    @property
    def measured_comm_s(self) -> float:
        return max(r.comm_s for r in self.profile.ranks)

    @property
    def compute_error(self) -> float:
        return rel_error(self.est_compute_s, self.measured_compute_s)

    @property
    def time_error(self) -> float:
        return rel_error(self.est_time_s, self.measured_time_s)

    @property
    def host_time_error(self) -> float | None:
        """The step-time error with the estimate scaled by the host's speed then."""
        if self.host is None:
            return None
        return rel_error(self.est_time_s * self.host, self.measured_time_s)

    @property
    def memory_error(self) -> float:
        return rel_error(self.est_memory_bytes, self.measured_memory_bytes)

    @property
    def liveness_error(self) -> float:
        return rel_error(self.liveness_peak_bytes, self.measured_memory_bytes)

    def to_json(self) -> dict:
        ranks = self.profile.ranks
        return {
            "devices": self.devices,
            "mesh": list(self.mesh),
            "point": self.index,
            "frontier_points": self.frontier_size,
            "summary": self.summary,
            "axes": self.axes or {"micro_batches": 1, "zero": 0, "recompute_blocks": 0},
            "estimate": {
                "time_s": self.est_time_s,
                "compute_s": self.est_compute_s,
                "comm_s": self.est_time_s - self.est_compute_s,
                "memory_bytes": self.est_memory_bytes,
                "liveness_peak_bytes": self.liveness_peak_bytes,
                "state_bytes": self.state_bytes,
                "graph_comm_s": self.graph_comm_s,
                "graph_collectives": self.collectives,
            },
            "measured": {
                "time_s": self.measured_time_s,
                "memory_bytes": self.measured_memory_bytes,
                "compute_s": self.measured_compute_s,
                "compute_cpu_s": max(r.compute_cpu_s for r in ranks),
                "comm_s": self.measured_comm_s,
                "step_spread": max(r.step_spread for r in ranks),
                "ranks": [r.to_json() for r in ranks],
                "memory_link": self.link.to_json() if self.link else None,
                "host_speed_ratio": self.host,
                "round_times_s": list(self.round_times_s),
            },
            "time_rel_error": self.time_error,
            "time_rel_error_host_corrected": self.host_time_error,
            "compute_rel_error": self.compute_error,
            "memory_rel_error": self.memory_error,
            "liveness_rel_error": self.liveness_error,
        }


@dataclass(frozen=True, slots=True)
class GraphFacts:
    """What the emitted device graphs say, largest over the ranks."""

    liveness_peak: int
    state_bytes: int
    collectives: int
    comm_s: float  # their collectives priced by the link's alpha-beta


def graph_facts(outdir: str, link) -> GraphFacts:
    """Static facts of a compiled directory: liveness peak, state, collectives and their
    alpha-beta time (``count x latency terms x alpha + bytes sent / bandwidth``)."""
    import json

    from tensoropt.passes.device_stats import device_stats
    from tensoropt.passes.stages import P2P_OPS

    with open(os.path.join(outdir, "manifest.json")) as f:
        step = json.load(f)["step"]
    facts = []
    for name in sorted(os.listdir(outdir)):
        if not (name.startswith("device_") and name.endswith(".onnx")):
            continue
        model = onnx.load(os.path.join(outdir, name))
        stats = device_stats(model, list(step["params"]), list(step["states"]))
        # collectives per step as every command counts them (device_stats.
        # collectives_per_step): a pipeline's Sends are traffic, not collectives
        count = sum(c.count for c in stats.collectives if c.kind not in P2P_OPS)
        alphas = sum(c.count * (2 if c.kind == "AllReduce" else 1) for c in stats.collectives)
        seconds = alphas * link.alpha_s + stats.bytes_sent / link.bandwidth
        facts.append(GraphFacts(stats.peak_bytes, stats.state_bytes, count, seconds))
    return GraphFacts(
        max(f.liveness_peak for f in facts),
        max(f.state_bytes for f in facts),
        max(f.collectives for f in facts),
        max(f.comm_s for f in facts),
    )


def _median_abs(values: Sequence[float]) -> float | None:
    return float(np.median(np.abs(values))) if values else None


def by_memory_link(checks: Sequence[PlanCheck]) -> dict[str, dict]:
    """Step-time errors of the probed (multi-device) plans, split by the memory link the
    probe found before each ran: per group ("own", "shared") the plan count, the median
    |error| and the signed median. The estimate assumes a memory link per rank (design.md
    decision 41), so the "own" group measures the model and the gap to "shared" the
    host's co-location of the ranks."""
    out = {}
    for name, shared in (("own", False), ("shared", True)):
        errors = [c.time_error for c in checks if c.link is not None and c.link.shared is shared]
        if errors:
            out[name] = {
                "plans": len(errors),
                "median_time_rel_error": _median_abs(errors),
                "signed_median_time_rel_error": float(np.median(errors)),
            }
    return out


def report_json(checks: Sequence[PlanCheck], meta: dict) -> dict:
    """The ``--json`` document: summary errors, then every plan."""
    return {
        "schema": SCHEMA,
        **meta,
        "plans": len(checks),
        "median_time_rel_error": _median_abs([c.time_error for c in checks]),
        "median_memory_rel_error": _median_abs([c.memory_error for c in checks]),
        "median_liveness_rel_error": _median_abs([c.liveness_error for c in checks]),
        "median_compute_rel_error": _median_abs([c.compute_error for c in checks]),
        "median_graph_comm_rel_error": _median_abs(
            [rel_error(c.graph_comm_s, c.measured_comm_s) for c in checks if c.devices > 1]
        ),
        "median_time_rel_error_host_corrected": _median_abs(
            [c.host_time_error for c in checks if c.host_time_error is not None]
        ),
        "plans_on_shared_memory_link": sum(1 for c in checks if c.link and c.link.shared),
        "time_rel_error_by_memory_link": by_memory_link(checks),
        "error_definition": "|estimate - measured| / measured (medians); signed per plan",
        "results": [c.to_json() for c in checks],
    }


def mesh_text(c: PlanCheck) -> str:
    """The plan's mesh as the search's tables show it: "2x2", a pipeline's "pp2:2"."""
    from tensoropt.search.driver import mesh_label

    return mesh_label(c.mesh, (c.axes or {}).get("stages", 1))


def table(checks: Sequence[PlanCheck]) -> str:
    head = (
        f"{'dev':>3} {'mesh':>5} {'pt':>3}  {'est ms':>8} {'meas ms':>8} {'err':>6} "
        f"{'comp err':>8} {'link':>11} {'host':>5}  "
        f"{'est MiB':>8} {'live MiB':>8} {'meas MiB':>8} {'err':>6}  plan"
    )
    lines = [head]
    for c in checks:
        lines.append(
            f"{c.devices:>3} {mesh_text(c):>5} {c.index:>3}  "
            f"{c.est_time_s * 1e3:>8.3f} {c.measured_time_s * 1e3:>8.3f} {c.time_error:>+6.0%} "
            f"{c.compute_error:>+8.0%} {link_label(c.link):>11} {host_label(c.host):>5}  "
            f"{c.est_memory_bytes / 2**20:>8.2f} {c.liveness_peak_bytes / 2**20:>8.2f} "
            f"{c.measured_memory_bytes / 2**20:>8.2f} {c.memory_error:>+6.0%}  {c.summary}"
        )
    t = _median_abs([c.time_error for c in checks])
    m = _median_abs([c.memory_error for c in checks])
    live = _median_abs([c.liveness_error for c in checks])
    lines.append(
        f"median |relative error| over {len(checks)} plans: step time {t:.1%}, "
        f"memory (search estimate) {m:.1%}, memory (static liveness) {live:.1%}"
    )
    hosted = [c.host_time_error for c in checks if c.host_time_error is not None]
    if hosted:
        ratio = float(np.median([c.host for c in checks if c.host is not None]))
        lines.append(
            f"host: the reference ran x{ratio:.2f} its calibrated time (median over the plans; "
            f"> 1 slower); step time with each estimate scaled by its plan's ratio: "
            f"{_median_abs(hosted):.1%}"
        )
    probed = [c for c in checks if c.link is not None]
    shared = sum(1 for c in probed if c.link.shared)
    if shared:
        lines.append(
            f"{shared} of {len(probed)} multi-device plans ran while the ranks shared a "
            "memory link (link: processes streaming at once got under 75% of one alone's "
            "bandwidth each); their memory-bound ops ran slower than calibrated"
        )
        groups = by_memory_link(checks)
        lines.append(
            "step time by memory link (the estimate assumes one per rank): "
            + "; ".join(
                f"{name} {g['median_time_rel_error']:.1%} over {g['plans']} plan(s), signed "
                f"median {g['signed_median_time_rel_error']:+.1%}"
                for name, g in groups.items()
            )
        )
    return "\n".join(lines)


def link_label(link: LinkProbe | None) -> str:
    """The table's link column: own or shared, with the probe's ratio; '-' unprobed."""
    if link is None:
        return "-"
    return f"{'shared' if link.shared else 'own'} {link.ratio:.2f}"


def host_label(host: float | None) -> str:
    """The table's host column: the reference's time around the run over the calibrated."""
    return "-" if host is None else f"x{host:.2f}"


def plot(checks: Sequence[PlanCheck], path: str) -> None:
    """Two log-log scatters (time, memory) of estimate against measurement, with y = x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tensoropt.runtime.checkpoint import write_atomic

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    ms = [c.measured_time_s * 1e3 for c in checks]
    mib = [c.measured_memory_bytes / 2**20 for c in checks]
    panels = (
        ("step time (ms)", ms, [c.est_time_s * 1e3 for c in checks]),
        ("memory per device (MiB)", mib, [c.est_memory_bytes / 2**20 for c in checks]),
    )
    for ax, (what, measured, estimated) in zip(axes, panels, strict=True):
        for d in sorted({c.devices for c in checks}):
            xs = [m for m, c in zip(measured, checks, strict=True) if c.devices == d]
            ys = [e for e, c in zip(estimated, checks, strict=True) if c.devices == d]
            ax.scatter(xs, ys, label=f"{d} device{'s' if d > 1 else ''}", s=24)
        if what.startswith("memory"):
            live = [c.liveness_peak_bytes / 2**20 for c in checks]
            ax.scatter(measured, live, marker="x", c="gray", s=20, label="static liveness")
        lo = min(min(measured), min(estimated)) / 1.5
        hi = max(max(measured), max(estimated)) * 1.5
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="y = x")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"measured {what}")
        ax.set_ylabel(f"estimated {what}")
        ax.grid(True, which="both", alpha=0.3)
        # right of the axes: inside, it covered points in a corner
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.suptitle("Cost model against measurements")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, buffer.getvalue())
