"""How far a profile's estimates are expected to be off: the error band of an estimate.

A calibrated profile (``tensoropt calibrate``) can carry the history of ``tensoropt
validate --record`` runs made with it: per compiled and measured plan, its device count
and the signed relative errors of its step time and memory. The band of an estimate is
the median absolute error of the recorded plans of the same kind (one device, or
several: the multi-rank error is of another nature), so that about half the plans
measured so far were within it. Without a record, the band of the step time is the
calibration's own measurement spread (the median IQR / median of the compute kernels'
rates), which bounds the error from below and is labelled as such; a built-in profile
has no band at all (nothing was measured).

Two frontier points whose step times differ by less than the band are a *near-tie*: the
estimate cannot order them, and the tables say so (``near_ties``).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from tensoropt.errors import TensorOptError

HISTORY_LIMIT = 400  # plans kept in a profile's record (the most recent)
NOTE_POINTS = 5  # near-ties named by compile's note (the nearest in step time)


@dataclass(frozen=True, slots=True)
class ErrorBand:
    """Relative error bands of a profile's estimates (None: not known)."""

    time_one: float | None  # step time, plans on one device
    time_multi: float | None  # step time, plans on several devices
    memory: float | None  # memory per device, any plan
    source: str  # where the figures come from, for the tables

    def time(self, devices: int) -> float | None:
        return self.time_one if devices == 1 else self.time_multi

    def describe(self, devices: int) -> str:
        band = self.time(devices)
        if band is None:
            return ""
        return f"step time typically within +-{band:.0%} ({self.source})"

    def to_json(self) -> dict:
        return {
            "time_one_device": self.time_one,
            "time_several_devices": self.time_multi,
            "memory": self.memory,
            "source": self.source,
        }


def band_of(cluster: str) -> ErrorBand | None:
    """The band of the profile ``cluster`` names: from its validate record, else from its
    calibration spread; None for a built-in profile or a file with neither."""
    if not cluster.endswith(".json") or not os.path.isfile(cluster):
        return None
    with open(cluster) as f:
        obj = json.load(f)
    plans = (obj.get("accuracy") or {}).get("plans") or []
    if plans:
        one = [abs(p["time"]) for p in plans if p["devices"] == 1]
        multi = [abs(p["time"]) for p in plans if p["devices"] > 1]
        memory = [abs(p["memory"]) for p in plans]
        runs = len({p.get("run") for p in plans})
        return ErrorBand(
            statistics.median(one) if one else None,
            statistics.median(multi) if multi else None,
            statistics.median(memory) if memory else None,
            f"validated: median error of {len(plans)} plans in {runs} validate runs",
        )
    spreads = [float(x) for x in ((obj.get("spread") or {}).get("op_throughput") or {}).values()]
    if spreads:
        floor = statistics.median(spreads)
        return ErrorBand(
            floor,
            floor,
            None,
            "calibration spread only, not validated: `tensoropt validate --record`",
        )
    return None


def near_ties(times: Sequence[float], band: float | None) -> list[bool]:
    """Per point of a frontier (fastest first): whether its step time is within ``band``
    (relative) of the point before it, so that the estimate cannot order the two."""
    if band is None:
        return [False] * len(times)
    return [k > 0 and times[k] - times[k - 1] <= band * times[k - 1] for k in range(len(times))]


def record(cluster: str, model: str, results: Sequence[tuple[int, float, float]]) -> int:
    """Append one validate run's plans (devices, signed time error, signed memory error)
    to the profile file ``cluster``, keeping the last HISTORY_LIMIT plans. The file is
    replaced whole (written next to it, then renamed). Returns the plans it now holds."""
    if not cluster.endswith(".json") or not os.path.isfile(cluster):
        raise TensorOptError(
            f"--record needs a profile file from `tensoropt calibrate`, not {cluster!r}"
        )
    with open(cluster) as f:
        obj = json.load(f)
    run = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    plans = list((obj.get("accuracy") or {}).get("plans") or [])
    for devices, time_err, memory_err in results:
        if math.isfinite(time_err) and math.isfinite(memory_err):
            plans.append(
                {"run": run, "model": model, "devices": devices, "time": time_err,
                 "memory": memory_err}
            )  # fmt: skip
    plans = plans[-HISTORY_LIMIT:]
    obj["accuracy"] = {
        "definition": "per validated plan: (estimate - measured) / measured",
        "plans": plans,
    }
    where = os.path.dirname(os.path.abspath(cluster))
    fd, tmp = tempfile.mkstemp(prefix=".profile-", suffix=".json", dir=where)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
        os.replace(tmp, cluster)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return len(plans)


def near_tie_note(
    times: Sequence[float],
    memories: Sequence[float],
    picked: int,
    band: ErrorBand | None,
    devices: int,
) -> str | None:
    """A note naming the other frontier points whose step time is within the band of
    the picked one's (``--pick`` ranks by the estimate alone), or None."""
    width = band.time(devices) if band is not None else None
    if width is None:
        return None
    t = times[picked]
    close = [k for k in range(len(times)) if k != picked and abs(times[k] - t) <= width * t]
    if not close:
        return None
    nearest = sorted(sorted(close, key=lambda k: abs(times[k] - t))[:NOTE_POINTS])
    listed = ", ".join(
        f"{k} ({times[k] * 1e3:.3f} ms, {memories[k] / 2**20:.1f} MiB)" for k in nearest
    )
    if len(close) > len(nearest):
        listed += f" and {len(close) - len(nearest)} more"
    return (
        f"near-ties: at {devices} devices, point(s) {listed} are within the +-{width:.0%} "
        f"band of point {picked}'s step time ({band.source}): the estimate cannot order "
        "them; --pick INDEX compiles another"
    )
