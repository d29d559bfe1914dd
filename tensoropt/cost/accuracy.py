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

The memory link is the host's case, not the plan's: ranks on one host either stream
from memory on links of their own or share one, and which one a host gives can change
from minute to minute (docs/design/measured.md). The estimate assumes a link per rank.
``LinkRecord`` says how the profile's own measurements found the link (the calibration's
probes) and, from the validate record, how far multi-device plans were off on each kind
of link, so that ``search`` and ``compile`` say which case their estimates assume and
what the other case has cost on this host.
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

from tensoropt.cost.cluster import read_cluster_file
from tensoropt.errors import TensorOptError

HISTORY_LIMIT = 400  # plans kept in a profile's record (the most recent)
NOTE_POINTS = 5  # near-ties named by compile's note (the nearest in step time)


@dataclass(frozen=True, slots=True)
class LinkRecord:
    """How the host's memory link stood in a profile's measurements."""

    probes: int  # the calibration's memory-link probes (ranks streaming at once)
    shared_probes: int  # of them, with the ranks sharing one link
    ratios: tuple[float, float]  # per-process bandwidth over one alone's: least, most
    # recorded multi-device plans per link: (plans, signed median step-time error)
    own: tuple[int, float] | None = None
    shared: tuple[int, float] | None = None

    def describe(self) -> str:
        text = "estimates assume a memory link per rank"
        if self.probes:
            lo, hi = self.ratios
            text += (
                f"; the calibration found ranks sharing one in {self.shared_probes} of "
                f"{self.probes} probes ({lo:.2f}-{hi:.2f} of one alone's bandwidth each)"
            )
        measured = [
            f"{kind} links {found[1]:+.0%} ({_count_of(found[0], 'plan')})"
            for kind, found in (("own", self.own), ("shared", self.shared))
            if found is not None
        ]
        if measured:
            text += "; validated multi-device step times, signed median: " + ", ".join(measured)
        elif self.shared_probes:
            text += "; memory-bound steps run slower on a shared one"
        return text

    def to_json(self) -> dict:
        return {
            "assumed": "own",
            "probes": self.probes,
            "shared_probes": self.shared_probes,
            "ratio_range": list(self.ratios) if self.probes else None,
            "validated": {
                kind: None if found is None else {"plans": found[0], "signed_median": found[1]}
                for kind, found in (("own", self.own), ("shared", self.shared))
            },
        }


def _count_of(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def link_record(obj: dict) -> LinkRecord | None:
    """The memory link in a profile document: its calibration's probes and its
    validate record's multi-device plans per link; None when neither says anything."""
    probes = ((obj.get("calibration") or {}).get("memory_link")) or []
    ratios = [float(p["ratio"]) for p in probes if "ratio" in p]
    plans = (obj.get("accuracy") or {}).get("plans") or []
    per_link: dict[str, list[float]] = {"own": [], "shared": []}
    for p in plans:
        link = p.get("link")
        if p["devices"] > 1 and link in per_link:
            per_link[link].append(p["time"])
    if not ratios and not any(per_link.values()):
        return None
    own, shared = (
        (len(errs), statistics.median(errs)) if errs else None
        for errs in (per_link["own"], per_link["shared"])
    )
    return LinkRecord(
        probes=len(ratios),
        shared_probes=sum(1 for p in probes if p.get("shared")),
        ratios=(min(ratios), max(ratios)) if ratios else (0.0, 0.0),
        own=own,
        shared=shared,
    )


@dataclass(frozen=True, slots=True)
class ErrorBand:
    """Relative error bands of a profile's estimates (None: not known)."""

    time_one: float | None  # step time, plans on one device
    time_multi: float | None  # step time, plans on several devices
    memory: float | None  # memory per device, any plan
    source: str  # where the figures come from, for the tables
    link: LinkRecord | None = None  # the host's memory link in the profile's measurements

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
            "memory_link": self.link.to_json() if self.link is not None else None,
        }

    def overview(self, devices: int) -> str:
        """The bands of one device and of several together, and for ``devices`` > 1 the
        memory-link case (``report``'s header)."""
        widths = [
            f"+-{width:.0%} on {where}"
            for width, where in ((self.time_one, "one device"), (self.time_multi, "several"))
            if width is not None
        ]
        text = f"step time typically within {', '.join(widths)} ({self.source})" if widths else ""
        return "; ".join(part for part in (text, self.link_note(devices)) if part)

    def link_note(self, devices: int) -> str | None:
        """Which memory-link case a multi-device estimate assumes, and what the profile
        measured of the other; None on one device or without a word from the profile."""
        if devices < 2 or self.link is None:
            return None
        return self.link.describe()


def band_of(cluster: str) -> ErrorBand | None:
    """The band of the profile ``cluster`` names: from its validate record, else from its
    calibration spread; None for a built-in profile or a file with neither."""
    if not cluster.endswith(".json") or not os.path.isfile(cluster):
        return None
    obj = read_cluster_file(cluster)  # refuses a malformed record, spread or probe
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
            link_record(obj),
        )
    spreads = [float(x) for x in ((obj.get("spread") or {}).get("op_throughput") or {}).values()]
    if spreads:
        floor = statistics.median(spreads)
        return ErrorBand(
            floor,
            floor,
            None,
            "calibration spread only, not validated: `tensoropt validate --record`",
            link_record(obj),
        )
    return None


def near_ties(times: Sequence[float], band: float | None) -> list[bool]:
    """Per point of a frontier (fastest first): whether its step time is within ``band``
    (relative) of the point before it, so that the estimate cannot order the two."""
    if band is None:
        return [False] * len(times)
    return [k > 0 and times[k] - times[k - 1] <= band * times[k - 1] for k in range(len(times))]


def record(
    cluster: str, model: str, results: Sequence[tuple[int, float, float, bool | None]]
) -> int:
    """Append one validate run's plans (devices, signed time error, signed memory error,
    whether its ranks shared a memory link: None where not probed) to the profile file
    ``cluster``, keeping the last HISTORY_LIMIT plans. The file is replaced whole
    (written next to it, then renamed). Returns the plans it now holds."""
    if not cluster.endswith(".json") or not os.path.isfile(cluster):
        raise TensorOptError(
            f"--record needs a profile file from `tensoropt calibrate`, not {cluster!r}"
        )
    obj = read_cluster_file(cluster)  # never append to a malformed file
    run = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    plans = list((obj.get("accuracy") or {}).get("plans") or [])
    for devices, time_err, memory_err, shared in results:
        if math.isfinite(time_err) and math.isfinite(memory_err):
            link = None if shared is None else ("shared" if shared else "own")
            plans.append(
                {"run": run, "model": model, "devices": devices, "time": time_err,
                 "memory": memory_err, "link": link}
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
