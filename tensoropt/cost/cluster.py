"""Cluster profiles: the rates the cost model uses (DESIGN §4).

A profile gives per-device compute (peak FLOP/s and memory bandwidth, with an
efficiency factor and a per-op floor), device memory, how many devices share a
node, and alpha-beta rates for links inside a node and between nodes. Built-in
profiles model common GPUs; ``--cluster FILE.json`` loads a profile, optionally
``"base"``-d on a built-in one, overriding any rate.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace

from tensoropt.errors import ClusterError

GIB = 1024**3
# The least memory_bytes a file may give: a device's memory in bytes. Below 1 MiB no
# model trains, and such a number is the capacity written in GiB or GB (80 for 80e9).
MIN_MEMORY_BYTES = 2**20
SCHEMA = "tensoropt.cluster/1"  # what `tensoropt calibrate` writes (calibrate.profile)


@dataclass(frozen=True, slots=True)
class Link:
    """Alpha-beta rates of one kind of link: latency (s) and bandwidth (bytes/s)."""

    alpha_s: float
    bandwidth: float


@dataclass(frozen=True, slots=True)
class OpCurve:
    """Measured rate of one op family against op size (``tensoropt calibrate``).

    ``work`` says what the size and the rate count: ``flops`` (FLOPs and FLOP/s, for
    contractions) or ``bytes`` (bytes moved and bytes/s, for memory-bound families).
    ``points`` are (size, rate) pairs sorted by size.
    """

    work: str
    points: tuple[tuple[float, float], ...]


@dataclass(frozen=True, slots=True)
class RateGrid:
    """Measured FLOP/s of a contraction against two shape keys (``tensoropt calibrate``).

    ``rates[i][j]`` is the rate at ``rows[i]`` and ``sides[j]``, interpolated bilinearly
    in log space, extrapolated along the first cell's slope below the smallest rows
    (:meth:`rate`) and held constant beyond the grid elsewhere. MatMul: the GEMM's output rows and
    the side sqrt(K * N) of the operand it packs once per call and every row reuses.
    Conv: channels and output positions (see :func:`tensoropt.cost.compute.conv_key`).
    A rate-against-FLOPs curve cannot express either: on the 2-core machine a
    16 x 1024 x 1024 MatMul ran at 85 GFLOP/s and a 256-row one at 216, and convs of
    equal FLOPs differed 5x with their channels.
    """

    rows: tuple[float, ...]
    sides: tuple[float, ...]
    rates: tuple[tuple[float, ...], ...]

    def rate(self, rows: float, side: float) -> float:
        i, u = _grid_pos(self.rows, rows)
        j, v = _grid_pos(self.sides, side)
        i1, j1 = min(i + 1, len(self.rows) - 1), min(j + 1, len(self.sides) - 1)
        r = self.rates
        low = math.log(r[i][j]) * (1 - v) + math.log(r[i][j1]) * v
        high = math.log(r[i1][j]) * (1 - v) + math.log(r[i1][j1]) * v
        if rows < self.rows[0] and len(self.rows) > 1:
            # Below the smallest measured rows (a micro-batch's GEMM) the rate keeps
            # falling along the first cell's log-log slope: the call's fixed costs
            # (packing the operand, the weight's traffic) do not shrink with the rows.
            # The slope is capped at 1, where the call's time stops falling.
            slope = min((high - low) / math.log(self.rows[1] / self.rows[0]), 1.0)
            return math.exp(low + max(slope, 0.0) * math.log(rows / self.rows[0]))
        return math.exp(low * (1 - u) + high * u)


def _grid_pos(axis: tuple[float, ...], x: float) -> tuple[int, float]:
    """(cell index, fraction in log space) of ``x`` on ``axis``, clamped to its ends."""
    if x <= axis[0] or len(axis) == 1:
        return 0, 0.0
    if x >= axis[-1]:
        return len(axis) - 1, 0.0
    i = max(k for k in range(len(axis)) if axis[k] <= x)
    return i, math.log(x / axis[i]) / math.log(axis[i + 1] / axis[i])


@dataclass(frozen=True, slots=True)
class ClusterProfile:
    """Rates of one kind of device and its interconnect."""

    name: str
    description: str
    peak_flops: float  # dense FLOP/s per device at the training precision
    memory_bandwidth: float  # bytes/s
    memory_bytes: float  # device memory capacity
    devices_per_node: int
    intra: Link
    inter: Link
    efficiency: float = 0.5  # fraction of peak a well-shaped kernel reaches
    op_floor_s: float = 5e-6  # smallest time of any kernel (launch overhead)
    # extra forward seconds per masked score of a Softmax (cost.compute.masked_time):
    # onnxruntime's CPU kernel takes a slow path where exp underflows; 0 where none was
    # measured (the built-in GPU profiles)
    softmax_masked_s: float = 0.0
    op_throughput: dict[str, float] = field(default_factory=dict)  # measured FLOP/s by family
    op_curves: dict[str, OpCurve] = field(default_factory=dict)  # measured rate vs size
    # measured (step - forward - update) / forward vs size: the backward's cost
    op_backward: dict[str, OpCurve] = field(default_factory=dict)
    # measured forward + backward FLOP/s of contractions inside a training step, against
    # their shape: ((kernel side, grid), ...) per family (MatMul: one slice, side 1)
    op_train_grids: dict[str, tuple[tuple[int, RateGrid], ...]] = field(default_factory=dict)
    # measured alpha-beta of each collective kind ("AllReduce", ...) inside one node
    # (calibrate's ``collectives.per_kind``); preferred over ``intra`` for that kind
    collective_links: dict[str, Link] = field(default_factory=dict)

    def link_for(self, kind: str, link: Link) -> Link:
        """The rates of collective ``kind`` on ``link`` (intra or inter).

        A calibrated profile measured every collective kind on one node; those fits are
        used on the intra-node link (they see the runtime's real per-kind costs, e.g. an
        AllReduce that is two passes, not the joint fit's average). Inter-node links were
        not measured per kind and keep the link's own rates."""
        if link == self.intra:
            return self.collective_links.get(kind, link)
        return link

    def to_json(self) -> dict:
        return asdict(self)


_BUILTIN = {
    "v100": ClusterProfile(
        "v100",
        "NVIDIA V100 16 GB, 8 per node over NVLink, nodes on 100 Gb/s InfiniBand",
        peak_flops=112e12,
        memory_bandwidth=900e9,
        memory_bytes=16 * GIB,
        devices_per_node=8,
        intra=Link(5e-6, 130e9),
        inter=Link(10e-6, 12.5e9),
    ),
    "a100": ClusterProfile(
        "a100",
        "NVIDIA A100 80 GB SXM, 8 per node over NVSwitch, 8x200 Gb/s HDR InfiniBand",
        peak_flops=312e12,
        memory_bandwidth=2.0e12,
        memory_bytes=80 * GIB,
        devices_per_node=8,
        intra=Link(4e-6, 300e9),
        inter=Link(8e-6, 25e9),
    ),
    "h100": ClusterProfile(
        "h100",
        "NVIDIA H100 80 GB SXM, 8 per node over NVSwitch, 8x400 Gb/s NDR InfiniBand",
        peak_flops=989e12,
        memory_bandwidth=3.35e12,
        memory_bytes=80 * GIB,
        devices_per_node=8,
        intra=Link(3e-6, 450e9),
        inter=Link(6e-6, 50e9),
    ),
    "h200": ClusterProfile(
        "h200",
        "NVIDIA H200 141 GB SXM, 8 per node over NVSwitch, 8x400 Gb/s NDR InfiniBand",
        peak_flops=989e12,
        memory_bandwidth=4.8e12,
        memory_bytes=141e9,
        devices_per_node=8,
        intra=Link(3e-6, 450e9),
        inter=Link(6e-6, 50e9),
    ),
}

BUILTIN_NAMES = tuple(_BUILTIN)


def builtin(name: str) -> ClusterProfile:
    try:
        return _BUILTIN[name.lower()]
    except KeyError:
        raise ClusterError(
            f"unknown cluster profile {name!r}; use one of {', '.join(BUILTIN_NAMES)} "
            "or a cluster JSON file"
        ) from None


def _shown(value) -> str:
    """``value`` as an error message shows it: its repr, cut to one short line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _at(where: str, key) -> str:
    """The path of ``key`` under ``where``: ``where.key``, or ``where['odd key']`` for a
    key that would not read as one word (spaces, dots, a line break: the message stays
    one line)."""
    key = str(key)
    if key and key.isprintable() and not any(c in key for c in " .[]'\""):
        return f"{where}.{key}"
    return f"{where}[{_shown(key)}]"


def _number(value, where: str) -> float:
    """A finite JSON number (not a bool, not a string holding one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ClusterError(f"{where}: expected a number, found {_shown(value)}")
    try:
        number = float(value)
    except OverflowError:  # an integer literal beyond a float's range
        number = math.inf
    if not math.isfinite(number):
        raise ClusterError(f"{where}: expected a finite number, found {_shown(value)}")
    return number


def _positive(value, where: str) -> float:
    number = _number(value, where)
    if number < 0:
        raise ClusterError(f"{where}: expected a finite rate >= 0, found {_shown(value)}")
    return number


def _count(value, where: str) -> int:
    """An integer >= 1 (a device, rank or thread count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ClusterError(f"{where}: expected an integer >= 1, found {_shown(value)}")
    return value


def _object(value, where: str, what: str = "an object") -> dict:
    if not isinstance(value, dict):
        raise ClusterError(f"{where}: expected {what}, found {_shown(value)}")
    return value


def _text(value, where: str) -> str:
    if not isinstance(value, str):
        raise ClusterError(f"{where}: expected a string, found {_shown(value)}")
    return value


def _link(obj, base: Link, where: str) -> Link:
    _object(obj, where, "an object with alpha_s and bandwidth")
    unknown = set(obj) - {"alpha_s", "bandwidth"}
    if unknown:
        raise ClusterError(f"{where}: unknown keys {sorted(unknown)}")
    alpha = _positive(obj.get("alpha_s", base.alpha_s), f"{where}.alpha_s")
    bw = _positive(obj.get("bandwidth", base.bandwidth), f"{where}.bandwidth")
    if bw == 0:
        raise ClusterError(f"{where}.bandwidth: must be > 0")
    return Link(alpha, bw)


COLLECTIVE_KINDS = ("AllReduce", "AllGather", "ReduceScatter", "AllToAll")


def _collective_links(obj, where: str) -> dict[str, Link]:
    """``collectives.per_kind`` of a calibrated profile: {kind: {alpha_s, bandwidth, ...}}."""
    _object(obj, where)
    return _kind_links(obj.get("per_kind", {}), f"{where}.per_kind")


def _kind_links(table, where: str) -> dict[str, Link]:
    """{kind: {alpha_s, bandwidth, ...}}: a link fit per collective kind."""
    _object(table, where)
    out = {}
    for kind, fit in table.items():
        at = _at(where, kind)
        if kind not in COLLECTIVE_KINDS:
            raise ClusterError(f"{at}: unknown collective; expected one of {COLLECTIVE_KINDS}")
        if not isinstance(fit, dict) or "alpha_s" not in fit or "bandwidth" not in fit:
            raise ClusterError(f"{at}: expected an object with alpha_s and bandwidth")
        alpha = _positive(fit["alpha_s"], f"{at}.alpha_s")
        out[kind] = Link(alpha, _rate(fit["bandwidth"], f"{at}.bandwidth"))
    return out


def _rate(value, where: str) -> float:
    rate = _positive(value, where)
    if rate == 0:
        raise ClusterError(f"{where}: expected a rate > 0, found 0")
    return rate


def _entries(table, where: str) -> list[tuple[str, object, str]]:
    """(family, value, where-path) of an object keyed by op family (or op type)."""
    _object(table, where, "an object of op families")
    return [(fam, value, _at(where, fam)) for fam, value in table.items()]


def _curves(table, where: str) -> dict[str, OpCurve]:
    """``{family: {"work": "flops"|"bytes", "points": [[size, rate, (spread)], ...]}}``."""
    out = {}
    for fam, curve, at in _entries(table, where):
        if not isinstance(curve, dict) or curve.get("work") not in ("flops", "bytes"):
            raise ClusterError(f'{at}: expected {{"work": "flops"|"bytes", "points": [...]}}')
        points = curve.get("points")
        if not isinstance(points, list) or not points:
            raise ClusterError(f"{at}.points: expected a non-empty list of [size, rate]")
        pairs = []
        for i, row in enumerate(points):
            if not isinstance(row, list) or len(row) < 2:
                raise ClusterError(f"{at}.points[{i}]: expected [size, rate, (spread)]")
            pairs.append(
                (_rate(row[0], f"{at}.points[{i}][0]"), _rate(row[1], f"{at}.points[{i}][1]"))
            )
        out[fam] = OpCurve(curve["work"], tuple(sorted(pairs)))
    return out


def _grids(table, where: str) -> dict[str, RateGrid]:
    """``{family: {"rows": [...], "sides": [...], "rates": [[FLOP/s per side] per row]}}``."""
    out = {}
    for fam, grid, at in _entries(table, where):
        if not isinstance(grid, dict) or not all(k in grid for k in ("rows", "sides", "rates")):
            expected = '{"rows": [...], "sides": [...], "rates": [[...]]}'
            raise ClusterError(f"{at}: expected {expected}")
        axes = []
        for key in ("rows", "sides"):
            values = grid[key]
            if not isinstance(values, list) or not values:
                raise ClusterError(f"{at}.{key}: expected a non-empty increasing list")
            axis = tuple(_rate(v, f"{at}.{key}[{i}]") for i, v in enumerate(values))
            if any(b <= a for a, b in zip(axis, axis[1:], strict=False)):
                raise ClusterError(f"{at}.{key}: expected strictly increasing values")
            axes.append(axis)
        rates = grid["rates"]
        if not isinstance(rates, list) or len(rates) != len(axes[0]):
            raise ClusterError(f"{at}.rates: expected one row of rates per entry of rows")
        table_rows = []
        for i, row in enumerate(rates):
            if not isinstance(row, list) or len(row) != len(axes[1]):
                raise ClusterError(f"{at}.rates[{i}]: expected one rate per entry of sides")
            table_rows.append(tuple(_rate(r, f"{at}.rates[{i}][{j}]") for j, r in enumerate(row)))
        out[fam] = RateGrid(axes[0], axes[1], tuple(table_rows))
    return out


def _train_grids(table, where: str) -> dict[str, tuple[tuple[int, RateGrid], ...]]:
    """``{family: {"kernel_K": {"rows": [...], "sides": [...], "rates": [[...]]}, ...}}``.

    K is the kernel side of that slice (1 for MatMul). A grid's ``rates[i][j]`` is the
    FLOP/s at ``rows[i]`` and ``sides[j]`` (see :class:`RateGrid`)."""
    out = {}
    for fam, slices, at in _entries(table, where):
        if not isinstance(slices, dict) or not slices:
            raise ClusterError(f'{at}: expected {{"kernel_1": {{...}}, "kernel_3": {{...}}}}')
        parsed = []
        for key, grid in slices.items():
            side = key.removeprefix("kernel_")
            ok = key.startswith("kernel_") and side.isascii() and side.isdigit()
            if not ok or int(side) < 1:
                raise ClusterError(f"{_at(at, key)}: expected a key kernel_K with K >= 1")
            parsed.append((int(side), _grids({key: grid}, at)[key]))
        out[fam] = tuple(sorted(parsed, key=lambda s: s[0]))
    return out


def from_json(obj, where: str) -> ClusterProfile:
    """A profile from a JSON object; ``base`` names a built-in profile to start from."""
    if not isinstance(obj, dict):
        raise ClusterError(f"{where}: expected a JSON object")
    base_name = obj.get("base")
    if base_name is None and "peak_flops" not in obj:
        raise ClusterError(
            f'{where}: give "base": one of {", ".join(BUILTIN_NAMES)}, or every rate '
            "(peak_flops, memory_bandwidth, memory_bytes, devices_per_node, intra, inter)"
        )
    base = None
    if base_name is not None:
        if not isinstance(base_name, str) or base_name.lower() not in _BUILTIN:
            raise ClusterError(
                f"{where}.base: expected the name of a built-in profile "
                f"({', '.join(BUILTIN_NAMES)}), found {_shown(base_name)}"
            )
        base = _BUILTIN[base_name.lower()]
    names = {f.name for f in fields(ClusterProfile)}
    extra = {"base", "schema", "machine", "versions", "spread", "collectives", "calibration"}
    extra.add("accuracy")  # validate --record's history (cost.accuracy)
    unknown = set(obj) - names - extra
    if unknown:
        raise ClusterError(f"{where}: unknown keys {sorted(unknown)}")
    values = {}
    rates = ("peak_flops", "memory_bandwidth", "memory_bytes", "efficiency", "op_floor_s")
    for key in (*rates, "softmax_masked_s"):
        if key in obj:
            values[key] = _positive(obj[key], f"{where}.{key}")
        elif base is None and key not in ("efficiency", "op_floor_s", "softmax_masked_s"):
            raise ClusterError(f"{where}: missing rate {key!r}")
    for key in ("peak_flops", "memory_bandwidth", "memory_bytes", "efficiency"):
        if values.get(key) == 0:
            raise ClusterError(f"{where}.{key}: must be > 0")
    if values.get("efficiency", 1.0) > 1:  # a fraction of peak_flops
        raise ClusterError(
            f"{where}.efficiency: expected the fraction of peak_flops a kernel reaches, "
            f"in (0, 1], found {_shown(obj['efficiency'])}"
        )
    if values.get("memory_bytes", MIN_MEMORY_BYTES) < MIN_MEMORY_BYTES:
        raise ClusterError(
            f"{where}.memory_bytes: expected a device's memory in bytes, at least 1 MiB "
            f"(e.g. 80e9), found {_shown(obj['memory_bytes'])}"
        )
    if "devices_per_node" in obj:
        values["devices_per_node"] = _count(obj["devices_per_node"], f"{where}.devices_per_node")
    elif base is None:
        raise ClusterError(f"{where}: missing 'devices_per_node'")
    for key in ("intra", "inter"):
        if key in obj:
            # a partial override keeps the base's other rate of the same link
            start = getattr(base, key) if base else Link(0, 1)
            values[key] = _link(obj[key], start, f"{where}.{key}")
        elif base is None:
            raise ClusterError(f"{where}: missing link {key!r}")
    if "op_throughput" in obj:
        values["op_throughput"] = {
            fam: _rate(v, at)
            for fam, v, at in _entries(obj["op_throughput"], f"{where}.op_throughput")
        }
    for key in ("op_curves", "op_backward"):
        if key in obj:
            values[key] = _curves(obj[key], f"{where}.{key}")
    if "op_train_grids" in obj:
        values["op_train_grids"] = _train_grids(obj["op_train_grids"], f"{where}.op_train_grids")
    if "collective_links" in obj:  # the profile's own field, as to_json writes it
        values["collective_links"] = _kind_links(
            obj["collective_links"], f"{where}.collective_links"
        )
    if "collectives" in obj:  # calibrate's fits: they win over collective_links
        values["collective_links"] = _collective_links(obj["collectives"], f"{where}.collectives")
    _check_records(obj, where)
    name = _text(obj.get("name", base.name + "+file" if base else "custom"), f"{where}.name")
    description = _text(obj.get("description", f"from {where}"), f"{where}.description")
    if base is None:
        return ClusterProfile(name=name, description=description, **values)
    return replace(base, name=name, description=description, **values)


def _check_records(obj: dict, where: str) -> None:
    """The sections that are no rates of the profile but are read later: ``schema``,
    ``machine`` and ``versions`` (calibrate --against), ``spread.op_throughput`` (the
    error band without a validate record), ``calibration`` (validate's threads per rank
    and host-speed reference; the memory-link probes) and ``accuracy`` (validate
    --record's history: cost.accuracy). Checked with the rates, so that a malformed one
    is refused when the file is loaded, before a command measures or writes anything."""
    if "schema" in obj and obj["schema"] != SCHEMA:
        raise ClusterError(f"{where}.schema: expected {SCHEMA!r}, found {_shown(obj['schema'])}")
    for key in ("machine", "versions"):
        if key in obj:
            _object(obj[key], f"{where}.{key}")
    if "spread" in obj:
        spread = _object(obj["spread"], f"{where}.spread")
        if "op_throughput" in spread:
            for _fam, value, at in _entries(
                spread["op_throughput"], f"{where}.spread.op_throughput"
            ):
                _positive(value, at)  # IQR / median of the family's rates
    if "calibration" in obj:
        _calibration(_object(obj["calibration"], f"{where}.calibration"), f"{where}.calibration")
    if "accuracy" in obj:
        check_history(obj["accuracy"], f"{where}.accuracy")


LINKS = ("own", "shared")  # a recorded plan's memory link (accuracy.LinkRecord)


def check_history(accuracy, where: str) -> None:
    """A profile's ``accuracy`` section as :func:`record` writes it: ``{"definition":
    str, "plans": [{"devices": int >= 1, "time": number, "memory": number, "run": str,
    "model": str, "link": "own" | "shared" | null}, ...]}`` (``run``, ``model`` and
    ``link`` optional: older records lack them). ``time`` and ``memory`` are signed
    relative errors, (estimate - measured) / measured."""
    _object(accuracy, where, 'an object {"plans": [...]}')
    if "definition" in accuracy:
        _text(accuracy["definition"], f"{where}.definition")
    plans = accuracy.get("plans", [])
    if not isinstance(plans, list):
        raise ClusterError(f"{where}.plans: expected a list of plans, found {_shown(plans)}")
    for i, plan in enumerate(plans):
        at = f"{where}.plans[{i}]"
        _object(plan, at, 'an object {"devices": N, "time": error, "memory": error}')
        for key in ("devices", "time", "memory"):
            if key not in plan:
                raise ClusterError(f"{at}: missing {key!r}")
        _count(plan["devices"], f"{at}.devices")
        _number(plan["time"], f"{at}.time")
        _number(plan["memory"], f"{at}.memory")
        for key in ("run", "model"):
            if key in plan:
                _text(plan[key], f"{at}.{key}")
        if plan.get("link") not in (None, *LINKS):
            raise ClusterError(
                f'{at}.link: expected "own", "shared" or null, found {_shown(plan["link"])}'
            )


def _calibration(cal: dict, where: str) -> None:
    """The fields of ``calibration`` that commands read back."""
    if "threads_per_rank" in cal:
        _count(cal["threads_per_rank"], f"{where}.threads_per_rank")
    if "host_reference_s" in cal:
        _positive(cal["host_reference_s"], f"{where}.host_reference_s")
    if "memory_link" in cal:
        probes = cal["memory_link"]
        if not isinstance(probes, list):
            raise ClusterError(
                f"{where}.memory_link: expected a list of probes, found {_shown(probes)}"
            )
        for i, probe in enumerate(probes):
            at = f"{where}.memory_link[{i}]"
            _object(probe, at, "an object {alone_Bps, together_Bps, processes, ratio, shared}")
            if "ratio" in probe and _number(probe["ratio"], f"{at}.ratio") <= 0:
                raise ClusterError(
                    f"{at}.ratio: expected a bandwidth ratio > 0, found {_shown(probe['ratio'])}"
                )
            if "shared" in probe and not isinstance(probe["shared"], bool):
                raise ClusterError(
                    f"{at}.shared: expected true or false, found {_shown(probe['shared'])}"
                )


def read_cluster_file(path: str) -> dict:
    """The JSON object of the cluster file ``path``, checked as :func:`from_json` checks
    it: what commands that read the file's other sections (``accuracy``, ``spread``,
    ``calibration``) start from."""
    obj = _read_json(path)
    from_json(obj, path)
    return obj


def _read_json(path: str):
    if not os.path.isfile(path):
        raise ClusterError(f"{path}: no such cluster file")
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, huge ints
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ClusterError(f"{path}: not valid JSON ({reason})") from None
    except OSError as exc:
        raise ClusterError(f"{path}: cannot read the cluster file ({exc.strerror})") from None
    return obj


def load_cluster(spec: str) -> ClusterProfile:
    """A built-in profile by name, or a cluster JSON file."""
    if spec.lower() in _BUILTIN:
        return _BUILTIN[spec.lower()]
    if not spec.endswith(".json") and not os.path.exists(spec):
        builtin(spec)  # raises with the list of names
    return from_json(_read_json(spec), spec)
