"""The search result as JSON (``search --json``/``--json-out``) and plans read back from it
(``compile --pick POLICY --search FILE``).

Exact frontiers reach thousands of points, each a choice of one strategy for each of
hundreds of units, so a point does not carry its plan. The document holds, per mesh, a
table of the strategies some point uses (per unit, as plan-file unit entries), and each
point is a vector of indices into that table, one per unit of the shared ``units`` list.
:func:`plan_of` expands a point into the same :class:`Plan` the search itself builds.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tensoropt.errors import InfeasibleError, PlanError, TensorOptError

SCHEMA = "tensoropt.search/2"

# The options that shape the training step (and so the units and strategies); compile
# must build the same step to use a point of the file.
STEP_OPTIONS = ("loss", "optimizer", "momentum", "trainable", "freeze", "input_shape")


class SearchFileError(TensorOptError):
    """A search JSON file that cannot be read back, or does not fit the compile request."""


def mesh_key(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape))


def problem_key(search) -> str:
    """The key of one problem in ``meshes``: the mesh, then its memory axes (e.g.
    "2x4", "8+zero-3+recompute+micro-4")."""
    tag = search.variant.tag()
    return mesh_key(search.mesh.shape) + (f"+{tag}" if tag else "")


def step_options(args) -> dict:
    return {name: getattr(args, name, None) for name in STEP_OPTIONS}


def search_document(sg, profile, exp, model_path: str, options: dict, band=None) -> dict:
    """The body of the search JSON (without ``schema``; see json_output.document).
    ``band``: the profile's ErrorBand (cost.accuracy), or None. The axes the search
    explored (``exp.space``) are recorded as ``axes_searched``, those of them that gave
    no problem as ``axes_idle``."""
    from tensoropt.cost.accuracy import near_ties
    from tensoropt.cost.summary import replicates_all
    from tensoropt.search.driver import (
        Axis,
        device_frontier,
        guarantee_of,
        idle_axes,
        reference_gaps,
    )
    from tensoropt.search.merge import fewer_devices

    shared = exp.searches[0].unit_names if exp.searches else ()
    tables = {id(s): _StrategyTable(s) for s in exp.searches}
    per_device: dict[str, list[dict]] = {}
    row_of: dict[tuple[int, int], int] = {}  # (id(search), point index) -> row
    frontiers = {d: device_frontier(exp, d) for d in sorted({s.devices for s in exp.searches})}
    fewer = fewer_devices(
        {d: [(p.time_s, p.memory_bytes) for _, p in f] for d, f in frontiers.items()}
    )
    for d, frontier in frontiers.items():
        rows = []
        ties = near_ties([p.time_s for _, p in frontier], band.time(d) if band else None)
        for i, (s, p) in enumerate(frontier):
            k = exp.index_of(s, p)
            row_of[(id(s), k)] = i
            rows.append(
                {
                    "index": i,
                    "mesh": list(s.mesh.shape),
                    "problem": problem_key(s),
                    "axes": s.variant.to_json(len(s.blocks)),
                    "time_s": p.time_s,
                    "memory_bytes": p.memory_bytes,
                    "samples_per_s": sg.batch / p.time_s,
                    "summary": s.summaries[k],
                    "replicates_all_work": replicates_all(s.summaries[k]),
                    # the fewest devices with a plan at most as slow and as large, if fewer
                    "no_better_than_devices": fewer(d, p.time_s, p.memory_bytes),
                    "choice": tables[id(s)].add(p.choice),
                    "near_tie_with_previous": ties[i],
                }
            )
            if s.stage_starts:
                rows[-1]["pipeline"] = {"starts": list(s.stage_starts[k]), "schedule": "1f1b"}
        per_device[str(d)] = rows
    return {
        "model": model_path,
        "step": options,
        "cluster": profile.to_json(),
        "batch": sg.batch,
        "epsilon": exp.epsilon,
        "guarantee": guarantee_of(exp),
        "memory_budget_bytes": exp.memory_budget,
        "axes_searched": [a.value for a in Axis if a in exp.space.axes],
        # asked axes that gave no problem, and why (ZeRO at one device, ...)
        "axes_idle": {a.value: why for a, why in idle_axes(exp).items()},
        # stages only at the device counts above this (the default's, across nodes); 0: all
        "stages_above_devices": exp.space.stages_above if Axis.STAGES in exp.space.axes else 0,
        "error_band": band.to_json() if band is not None else None,
        "units": list(shared),
        "meshes": {
            problem_key(s): {
                "devices": s.devices,
                "shape": list(s.mesh.shape),
                "axis_names": list(s.mesh.axis_names),
                "axes": s.variant.to_json(len(s.blocks)),
                "recompute": list(s.blocks),
                "units": None if s.unit_names == shared else list(s.unit_names),
                "strategies": tables[id(s)].json(),
            }
            for s in exp.searches
        },
        "per_device": per_device,
        "frontier": [
            {
                "devices": p.devices,
                "mesh": list(p.mesh),
                "problem": problem_key(exp.source_of(p)),
                "time_s": p.time_s,
                "memory_bytes": p.memory_bytes,
                "row": row_of.get((id(exp.source_of(p)), p.index)),
            }
            for p in exp.merged
        ],
        "references": [
            {
                "devices": s.devices,
                "mesh": list(s.mesh.shape),
                "problem": problem_key(s),
                "plan": name,
                "time_s": t,
                "memory_bytes": m,
                "summary": s.reference_summaries.get(name, ""),
            }
            for s in exp.searches
            for name, (t, m, _) in s.references.items()
        ],
        # the reference plans the searched axes call for that no problem of a device
        # count holds, with why (search.driver.reference_gaps)
        "references_missing": [
            {"devices": d, "plan": name, "reason": reason}
            for d in sorted({s.devices for s in exp.searches})
            for name, reason in reference_gaps(exp, d).items()
        ],
    }


class _StrategyTable:
    """The strategies of one mesh search that points use, renumbered per unit."""

    def __init__(self, search) -> None:
        self._layouts = search.unit_layouts
        self._zero = search.unit_zero  # per unit, per strategy (empty: no ZeRO)
        self._stage = search.variant.zero
        self._used: list[dict[int, int]] = [{} for _ in search.unit_names]

    def add(self, choice: Sequence[int]) -> list[int]:
        out = []
        for used, s in zip(self._used, choice, strict=True):
            out.append(used.setdefault(s, len(used)))
        return out

    def json(self) -> list[list[dict]]:
        table = []
        for u, (layouts, used) in enumerate(zip(self._layouts, self._used, strict=True)):
            entries = [None] * len(used)
            for s, k in used.items():
                inputs, outputs = layouts[s]
                entries[k] = {
                    "inputs": [None if lay is None else str(lay) for lay in inputs],
                    "outputs": [str(lay) for lay in outputs],
                }
                if self._zero and self._zero[u][s]:
                    entries[k]["zero"] = self._stage
            table.append(entries)
        return table


@dataclass(frozen=True, slots=True)
class SearchFile:
    """A search JSON document read back, checked enough to pick and expand points."""

    path: str
    doc: dict

    @property
    def device_counts(self) -> list[int]:
        return sorted(int(d) for d in self.doc["per_device"])

    def rows(self, devices: int) -> list[dict]:
        return self.doc["per_device"].get(str(devices), [])


def load_search(path: str) -> SearchFile:
    """Read ``path`` (written by ``search --json-out``); bad files are one-line errors."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise SearchFileError(
            f"--search {path}: no such file; write one with `tensoropt search MODEL "
            f"--json-out {path}`"
        ) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SearchFileError(f"--search {path}: not a readable JSON file ({first})") from None
    schema = doc.get("schema") if isinstance(doc, dict) else None
    if schema != SCHEMA:
        raise SearchFileError(
            f"--search {path}: schema {schema!r}, expected {SCHEMA!r}; write it again with "
            "`tensoropt search MODEL --json-out FILE`"
        )
    for key in ("units", "meshes", "per_device", "step", "cluster"):
        if key not in doc:
            raise SearchFileError(f"--search {path}: missing {key!r}; search again")
    return SearchFile(path, doc)


def check_matches(sf: SearchFile, options: dict, cluster: dict) -> None:
    """Refuse a compile whose step or cluster differs from the search's: the file's
    strategies belong to that step, and its figures to that cluster."""
    for name in STEP_OPTIONS:
        searched, given = sf.doc["step"].get(name), options.get(name)
        if _normal(searched) != _normal(given):
            flag = "--" + name.replace("_", "-")
            raise SearchFileError(
                f"--search {sf.path}: searched with {flag} {searched!r} but compiling with "
                f"{given!r}; give the same {flag} or search again"
            )
    searched = sf.doc["cluster"]
    if _normal(searched) != _normal(cluster):
        raise SearchFileError(
            f"--search {sf.path}: searched on cluster {searched.get('name')!r}, compiling for "
            f"{cluster.get('name')!r}; give the --cluster the search had"
        )


def inherit(sf: SearchFile, args) -> list[str]:
    """Give ``args`` the file's training options and cluster where the command line gave
    none (a point's strategies belong to the search's step, and its figures to its
    cluster); returns the flags taken that differ from the command's own defaults, as
    "--optimizer adam". A file whose cluster is no built-in profile cannot be taken by
    name: ``check_matches`` then asks for its --cluster."""
    from tensoropt.cli.common import given
    from tensoropt.cost.cluster import BUILTIN_NAMES, builtin

    taken = []
    for name in STEP_OPTIONS:
        searched = sf.doc["step"].get(name)
        if given(args, name) or _normal(searched) == _normal(getattr(args, name, None)):
            continue
        setattr(args, name, searched)
        values = searched if isinstance(searched, list) else [searched]
        taken += [f"--{name.replace('_', '-')} {v}" for v in values]
    cluster = sf.doc["cluster"]
    name = str(cluster.get("name", ""))
    if (
        not given(args, "cluster")
        and name.lower() in BUILTIN_NAMES
        and _normal(builtin(name).to_json()) == _normal(cluster)
        and name.lower() != str(getattr(args, "cluster", "")).lower()
    ):
        args.cluster = name
        taken.append(f"--cluster {name}")
    return taken


def _normal(value: object) -> object:
    """JSON round trip with byte counts as integers (how the file holds ``value``)."""
    from tensoropt.cli.json_output import integral_bytes

    return json.loads(json.dumps(integral_bytes(value)))


@dataclass(frozen=True, slots=True)
class PickedRow:
    devices: int
    index: int  # row in the per-device-count frontier (fastest first)
    row: dict


def pick_row(
    sf: SearchFile, devices: int, policy: str, parse_bytes: Callable[[str, str], float]
) -> PickedRow:
    """Apply a ``--pick`` policy to the file's frontiers, as ``search.driver.pick`` does to
    a search held in memory (same policies, same order: fastest first)."""
    from tensoropt.search.driver import Axis, memory_axes_advice, pick_index

    name, _, arg = policy.partition(":")
    searched = sf.doc.get("axes_searched")  # absent from files of older searches
    advice = ""
    if isinstance(searched, list):
        advice = memory_axes_advice(frozenset(a for a in Axis if a.value in searched))
        advice = advice.replace("--axes", "search --axes", 1)
    if name == "fewest-devices-under":
        budget = parse_bytes(arg, "--pick fewest-devices-under")
        counts = [d for d in sf.device_counts if d <= devices]
        for d in counts:
            for i, row in enumerate(sf.rows(d)):
                if row["memory_bytes"] <= budget:
                    return PickedRow(d, i, row)
        raise InfeasibleError(
            f"--pick {policy}: no plan of {sf.path} at {', '.join(map(str, counts)) or 'no'} "
            f"devices fits {arg} per device; add devices{advice}, or raise the budget"
        )
    rows = sf.rows(devices)
    if not rows:
        raise SearchFileError(
            f"--search {sf.path}: no frontier at {devices} devices (it has "
            f"{', '.join(map(str, sf.device_counts))}); search that device count"
        )
    memories = [row["memory_bytes"] for row in rows]
    k = pick_index(policy, memories, devices, parse_bytes, f" in {sf.path}", advice)
    return PickedRow(devices, k, rows[k])


def plan_of(sf: SearchFile, picked: PickedRow, source: str):
    """Expand one point of the file into its plan (explicit layouts for every unit)."""
    from tensoropt.ir.mesh import Mesh
    from tensoropt.ir.plan import DefaultStrategy, Plan, UnitStrategy
    from tensoropt.search.driver import Variant

    where = f"{sf.path}: per_device[{picked.devices}][{picked.index}]"
    key = picked.row.get("problem") or mesh_key(picked.row.get("mesh", ()))
    entry = sf.doc["meshes"].get(key)
    if not isinstance(entry, dict):
        raise SearchFileError(f"{where}: mesh {key!r} is not in the file's meshes")
    names = entry.get("units") or sf.doc["units"]
    table, choice = entry.get("strategies"), picked.row.get("choice")
    if not (isinstance(choice, list) and isinstance(table, list)):
        raise SearchFileError(f"{where}: no choice vector or strategy table; search again")
    if not len(names) == len(table) == len(choice):
        raise SearchFileError(
            f"{where}: {len(choice)} choices for {len(names)} units; the file is damaged"
        )
    mesh = Mesh(tuple(entry["shape"]), tuple(entry["axis_names"]))
    units = {}
    for name, options, k in zip(names, table, choice, strict=True):
        if not (isinstance(k, int) and 0 <= k < len(options)):
            raise SearchFileError(f"{where}: unit {name!r} has no strategy {k!r}")
        try:
            units[name] = UnitStrategy.from_json(options[k], mesh, f"{where} unit {name!r}")
        except PlanError as exc:
            raise SearchFileError(str(exc)) from None
    try:
        variant, _ = Variant.from_json(entry.get("axes") or {})
    except (AttributeError, TypeError, ValueError):
        raise SearchFileError(f"{where}: mesh {key!r} has unreadable axes; search again") from None
    pipeline = picked.row.get("pipeline") or {}
    try:
        return Plan(
            mesh,
            units,
            source=source,
            default=DefaultStrategy.DATA_PARALLEL,
            micro_batches=variant.micro_batches,
            recompute=tuple(entry.get("recompute") or ()) if variant.recompute else (),
            stages=tuple(pipeline.get("starts") or ()),
            schedule=pipeline.get("schedule", "1f1b"),
        )
    except PlanError as exc:
        raise SearchFileError(f"{where}: {exc}") from None
