"""Two calibrated profiles, rate by rate: what moved since the last calibration.

``calibrate --against OLD.json`` prints the rates that moved more than :data:`MOVED`
since OLD.json; ``benchmarks/bench_calibrate.py`` judges determinism (two calibrations
in a row) with the same comparison. The rates compared: every op family's median
throughput, every entry of the training-step grids (MatMul, Conv, BatchNorm), every
collective's alpha and bandwidth, and the joint link.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

from tensoropt.errors import ClusterError, TensorOptError

MOVED = 0.20  # what --against reports: a rate that moved more than this since OLD.json
# Two full calibrations in a row agree within this on every rate (the determinism
# benchmark's bound, benchmarks/bench_calibrate.py)
DETERMINISM = 0.15


class RateChange(NamedTuple):
    name: str
    first: float
    second: float

    @property
    def change(self) -> float:
        """second / first - 1."""
        return self.second / self.first - 1


def profile_rates(profile: dict) -> dict[str, float]:
    """Every rate of a calibrated profile, by a readable name."""
    out = {f"compute {fam}": rate for fam, rate in profile["op_throughput"].items()}
    for name, slices in profile.get("op_train_grids", {}).items():
        for kernel, grid in slices.items():
            for first, row in zip(grid["rows"], grid["rates"], strict=True):
                for second, rate in zip(grid["sides"], row, strict=True):
                    out[f"{name} {kernel} grid {first:g} x {second:g}"] = rate
    for kind, fit in profile["collectives"]["per_kind"].items():
        out[f"{kind} alpha"] = fit["alpha_s"]
        out[f"{kind} bandwidth"] = fit["bandwidth"]
    if profile.get("softmax_masked_s"):  # as a rate: masked scores per second
        out["softmax masked scores"] = 1.0 / profile["softmax_masked_s"]
    out["memory bandwidth"] = profile["memory_bandwidth"]  # the streaming floor's rate
    out["link alpha"] = profile["intra"]["alpha_s"]
    out["link bandwidth"] = profile["intra"]["bandwidth"]
    return out


def compare(first: dict, second: dict) -> list[RateChange]:
    """The rates both profiles have, in the first's order."""
    a, b = profile_rates(first), profile_rates(second)
    return [RateChange(name, a[name], b[name]) for name in a if name in b]


def load_baseline(path: str) -> dict:
    """A profile written by ``tensoropt calibrate``, checked before anything is measured."""
    from tensoropt.cost.cluster import from_json

    where = f"--against {path}"
    try:
        obj = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise TensorOptError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TensorOptError(f"{where}: not a JSON profile ({exc})") from None
    if not isinstance(obj, dict) or "calibration" not in obj or "collectives" not in obj:
        raise TensorOptError(
            f"{where}: not a calibrated profile (no 'calibration' or 'collectives'); give a "
            "file written by `tensoropt calibrate`"
        )
    try:
        from_json(obj, path)
        rates = profile_rates(obj)
    except ClusterError as exc:
        raise TensorOptError(f"{where}: {exc}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TensorOptError(f"{where}: incomplete profile ({type(exc).__name__}: {exc})") from None
    # each rate is compared as new / old: one that is not a positive number compares to
    # nothing (a zero alpha divided by zero after the whole calibration)
    bad = next(
        (name for name, rate in rates.items()
         if isinstance(rate, bool) or not isinstance(rate, (int, float))
         or not 0 < rate < math.inf),
        None,
    )  # fmt: skip
    if bad is not None:
        raise TensorOptError(
            f"{where}: its {bad} is {rates[bad]!r}, and a rate to compare against must be a "
            "positive number; give a file written by `tensoropt calibrate`"
        )
    return obj


def moved_report(old: dict, new: dict, label: str, show: int = 10) -> str:
    """Lines for the terminal: how many rates moved more than MOVED since ``old``, the
    ``show`` largest of them, and whether the two were measured on different machines."""
    rows = compare(old, new)
    moved = sorted((r for r in rows if abs(r.change) > MOVED), key=lambda r: -abs(r.change))
    machine = old.get("machine", {}), new.get("machine", {})
    same = all(machine[0].get(k) == machine[1].get(k) for k in ("cpu", "cores"))
    where = (
        ""
        if same
        else (f"; a different machine ({machine[0].get('cpu')}, {machine[0].get('cores')} cores)")
    )
    head = f"against {label} (calibrated {old['calibration'].get('date', '?')}{where}): "
    if not moved:
        return head + f"all {len(rows)} rates within {MOVED:.0%}"
    lines = [head + f"{len(moved)} of {len(rows)} rates moved more than {MOVED:.0%}"]
    width = max(len(r.name) for r in moved[:show])
    for r in moved[:show]:
        lines.append(f"  {r.name:<{width}}  {r.first:.4g} -> {r.second:.4g}  {r.change:+.1%}")
    if len(moved) > show:
        lines.append(f"  ... and {len(moved) - show} more")
    return "\n".join(lines)
