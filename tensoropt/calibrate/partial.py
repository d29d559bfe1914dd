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
    return Sample(float(v[0]), float(v[1]), int(v[2]))


def _result_json(result: KernelResult, overhead: float) -> dict:
    return {
        "case": result.case.label(),
        "seconds": _sample_json(result.seconds),
        "copies": result.copies,
        "step": _sample_json(result.step),
        "overhead_s": overhead,
    }


def _probe(d: dict) -> LinkProbe:
    return LinkProbe(float(d["alone_Bps"]), float(d["together_Bps"]), int(d["processes"]))


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
        (KernelResult(c, _whole(r["seconds"]), int(r["copies"]), _sample(r["step"])),
         float(r["overhead_s"]))
        for c, r in zip(cases, rows, strict=True)
    ]  # fmt: skip


def _differences(made: dict, here: dict) -> list[str]:
    keys = sorted(set(made) | set(here))
    return [k for k in keys if made.get(k) != here.get(k)]


def load(path: str, fingerprint: dict, cases: tuple[KernelCase, ...]) -> PartialState:
    """The finished passes in ``path``, refused (one line) when there are none or they
    were made with other options, on another machine or with other libraries."""
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
            list(data["runs"]),
            [_probe(p) for p in data["probes"]],
            float(data["seconds"]),
            [float(x) for x in data.get("references", [])],
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
