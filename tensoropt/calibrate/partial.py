"""The finished passes of an unfinished calibration (``calibrate --resume``).

After every compute pass, ``calibrate`` writes what it has measured so far (each
finished pass's case results, the collectives' MPI launches and memory-link probes
taken before it, the seconds spent) to ``OUTPUT.partial`` next to the output, atomically.
An interrupted calibration (Ctrl-C, SIGTERM, a kill) leaves that file; ``--resume``
reads it and measures only the passes that were not finished. The file records the
options and the machine it was made with: resuming with other options, or on another
machine or other library versions, would mix measurements of two setups in one profile,
so it is refused. A calibration that completes removes the file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

from tensoropt.calibrate.kernels import KernelCase, KernelResult
from tensoropt.calibrate.memlink import LinkProbe
from tensoropt.calibrate.stats import Sample
from tensoropt.errors import TensorOptError

FORMAT = "tensoropt.calibrate.partial/1"
SUFFIX = ".partial"


def partial_path(output: str) -> str:
    """Where the finished passes of a calibration writing ``output`` are kept."""
    return output + SUFFIX


def _sample_json(s: Sample | None) -> list | None:
    return None if s is None else [s.median, s.spread, s.repeats]


def _sample(v: list | None) -> Sample | None:
    return None if v is None else _whole(v)


def _whole(v: list) -> Sample:
    """A sample as the file keeps it, ``[median > 0, spread >= 0, repeats >= 1]``."""
    if not isinstance(v, list) or len(v) != 3:
        raise ValueError(f"a timing is [median, spread, repeats], found {v!r}")
    median, spread = _positive(v[0], "a median"), _number(v[1], "a spread")
    return Sample(median, spread, _count(v[2], "repeats"))


def _number(v: object, what: str) -> float:
    """``v``, a finite JSON number >= 0 (not a string, not a boolean)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
        raise ValueError(f"{what} must be a number >= 0, found {v!r}")
    return float(v)


def _positive(v: object, what: str) -> float:
    """``v``, a finite JSON number > 0."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
        raise ValueError(f"{what} must be a number > 0, found {v!r}")
    return float(v)


def _count(v: object, what: str) -> int:
    """``v``, a JSON integer >= 1."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{what} must be an integer >= 1, found {v!r}")
    return v


def _result_json(result: KernelResult, overhead: float) -> dict:
    return {
        "case": result.case.label(),
        "seconds": _sample_json(result.seconds),
        "copies": result.copies,
        "step": _sample_json(result.step),
        "overhead_s": overhead,
    }


def _probe(d: dict) -> LinkProbe:
    alone, together = (_positive(d[k], f"a memory-link probe's {k}") for k in PROBE_RATES)
    return LinkProbe(alone, together, _count(d["processes"], "processes"))


PROBE_RATES = ("alone_Bps", "together_Bps")


@dataclass(slots=True)
class PartialState:
    """What a calibration has finished: passes (in order), MPI runs, probes, seconds,
    host-speed reference timings."""

    fingerprint: dict
    passes: list[list[tuple[KernelResult, float]]] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)
    probes: list[LinkProbe] = field(default_factory=list)
    seconds: float = 0.0
    references: list[float] = field(default_factory=list)  # hostspeed.Reference timings

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "passes": [[_result_json(r, o) for r, o in done] for done in self.passes],
            "runs": self.runs,
            "probes": [p.to_json() for p in self.probes],
            "seconds": self.seconds,
            "references": self.references,
        }

    def write(self, path: str) -> None:
        from tensoropt.runtime.checkpoint import write_atomic

        write_atomic(path, (json.dumps(self.to_json()) + "\n").encode())


def _results(rows: list[dict], cases: tuple[KernelCase, ...]) -> list[tuple[KernelResult, float]]:
    if [r["case"] for r in rows] != [c.label() for c in cases]:
        raise ValueError("the cases differ")
    return [
        (KernelResult(c, _whole(r["seconds"]), _count(r["copies"], "copies"),
                      _sample(r["step"])),
         _number(r["overhead_s"], "overhead_s"))
        for c, r in zip(cases, rows, strict=True)
    ]  # fmt: skip


def _runs(runs: object, sizes: tuple[int, ...]) -> list[dict]:
    """The MPI launches' points, each ``{collective: [[bytes, seconds, spread], ...]}``
    with one row per message size."""
    from tensoropt.calibrate.collectives import KINDS

    if not isinstance(runs, list):
        raise ValueError(f"runs must be a list, found {type(runs).__name__}")
    kinds = sorted(k.value for k in KINDS)
    for run in runs:
        if not isinstance(run, dict) or sorted(run) != kinds:
            raise ValueError(f"a launch's points must hold {', '.join(kinds)}")
        for rows in run.values():
            if not isinstance(rows, list) or len(rows) != len(sizes):
                raise ValueError(f"a launch's collective must hold {len(sizes)} sizes")
            for row in rows:
                if not isinstance(row, list) or len(row) != 3:
                    raise ValueError(f"a point is [bytes, seconds, spread], found {row!r}")
                _positive(row[0], "a message's bytes")
                _positive(row[1], "a collective's seconds")
                _number(row[2], "a spread")
    return runs


def _expected(fingerprint: dict, passes: int) -> tuple[int, int, int]:
    """(MPI launches, memory-link probes, host-speed timings) a calibration with
    ``fingerprint``'s options has made when ``passes`` passes are finished: each is taken
    before a pass (``profile.calibrate``), so those before the unfinished one are saved."""
    from tensoropt.calibrate.collectives import launch_slots
    from tensoropt.calibrate.memlink import probe_processes

    launches = 0
    if fingerprint["backend"] == "mpi":
        slots = launch_slots(fingerprint["launches"], fingerprint["passes"])
        launches = sum(1 for index in slots if index < passes)
    probes = passes if probe_processes(fingerprint["ranks"]) else 0
    return launches, probes, passes


def _check_counts(path: str, state: PartialState, data: dict) -> None:
    """The file holds as many passes, launches, probes and timings as a calibration with
    its options saves: another count is a file edited or made by another program."""
    total = state.fingerprint["passes"]
    if len(state.passes) > total:
        raise TensorOptError(
            f"--resume: {path} holds {len(state.passes)} finished passes, and its "
            f"options ask for {total}; run calibrate without --resume to start over"
        )
    launches, probes, references = _expected(state.fingerprint, len(state.passes))
    counts = [("MPI launches", len(state.runs), launches),
              ("memory-link probes", len(state.probes), probes)]  # fmt: skip
    if "references" in data:  # files written before the host-speed timings lack them
        counts.append(("host-speed timings", len(state.references), references))
    for what, found, made in counts:
        if found != made:
            raise TensorOptError(
                f"--resume: {path} holds {found} {what} where {len(state.passes)} finished "
                f"pass(es) make {made}: it was edited or damaged; run calibrate without "
                "--resume to start over"
            )


def _differences(made: dict, here: dict) -> list[str]:
    keys = sorted(set(made) | set(here))
    return [k for k in keys if made.get(k) != here.get(k)]


def load(path: str, fingerprint: dict, cases: tuple[KernelCase, ...]) -> PartialState:
    """The finished passes in ``path``, refused (one line) when there are none or they
    were made with other options, on another machine or with other libraries."""
    from tensoropt.calibrate.collectives import sizes

    if not os.path.exists(path):
        raise TensorOptError(
            f"--resume: {path} does not exist, so there is nothing to resume; "
            "run calibrate without --resume"
        )
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if data.get("format") != FORMAT:
            raise ValueError("not a partial calibration")
        made = data["fingerprint"]
        if not isinstance(made, dict):
            raise ValueError("its fingerprint is not an object")
        moved = _differences(made, fingerprint)
        if moved:
            raise TensorOptError(
                f"--resume: {path} was made with other options or on another machine "
                f"({', '.join(moved)} differ); rerun with those options, or without --resume "
                "to start over"
            )
        state = PartialState(
            made,
            [_results(rows, cases) for rows in data["passes"]],
            _runs(data["runs"], sizes(made["quick"])),
            [_probe(p) for p in data["probes"]],
            _number(data["seconds"], "seconds"),
            [_positive(x, "a host-speed timing") for x in data.get("references", [])],
        )
    except TensorOptError:
        raise
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise TensorOptError(
            f"--resume: {path} is not a readable partial calibration ({exc}); "
            "run calibrate without --resume to start over"
        ) from None
    if not state.passes:
        raise TensorOptError(
            f"--resume: {path} holds no finished pass; run calibrate without --resume"
        )
    _check_counts(path, state, data)
    return state


@contextlib.contextmanager
def exclusive(output: str) -> Iterator[None]:
    """Hold the right to calibrate into ``output`` (and its partial file) for the block;
    refused, one line, while another calibration holds it. Two calibrations writing one
    output would replace each other's partial file, and a ``--resume`` would then mix
    their passes. The hold is a name in Linux's abstract socket namespace, derived from
    the output's real path: the kernel frees it when the process ends however it ends,
    so nothing is left on disk and no stale lock outlives a kill."""
    key = hashlib.sha256(os.path.realpath(output).encode()).hexdigest()[:32]
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # not inherited by children
    try:
        holder.bind(f"\0tensoropt-calibrate-{key}")
    except OSError as exc:
        holder.close()
        if exc.errno == errno.EADDRINUSE:
            raise TensorOptError(
                f"calibrate: another calibration is writing {output} now; wait for it to "
                "finish, or give another -o"
            ) from None
        # no abstract socket namespace here (not Linux, or a sandbox): calibrate unheld
    try:
        yield
    finally:
        holder.close()
