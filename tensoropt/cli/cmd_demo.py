"""``tensoropt demo``: the main job, start to finish, on a model where partitioning pays."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, fields

from tensoropt.cli.json_output import add_json_flag

JSON_SCHEMA = "tensoropt.demo/1"
DEVICES = 2  # the device count the demo compiles and runs
SEARCHED = "1,2,4,8"
MEMORY_AXES = "split,zero,recompute,micro"  # the second search's axes, at DEVICES

# The profile the demo prices plans with: a CPU-class device, close to what `tensoropt
# calibrate` measured on a 2-core x86 machine (contractions ~50 GFLOP/s at half of
# peak, collectives ~40 us + 2.5 GB/s through shared memory). The demo runs its plan on
# such a machine; on a GPU profile (`--cluster h100`) a model small enough to train here
# is dominated by per-kernel latency, and no plan beats one device.
CPU_PROFILE = {
    "name": "cpu-class",
    "description": "a CPU-class device: the demo's plans run on such a machine",
    "peak_flops": 1e11,
    "memory_bandwidth": 1e10,
    "memory_bytes": 8 * 2**30,
    "devices_per_node": 8,
    "op_floor_s": 1e-5,
    "intra": {"alpha_s": 4e-5, "bandwidth": 2.5e9},
    "inter": {"alpha_s": 1e-4, "bandwidth": 1e9},
}

EPILOG = f"""\
steps (each after the first an ordinary command, printed as it runs, so you can rerun
it by hand):
  1. writes DIR/cluster.json, a CPU-class cluster profile (100 GFLOP/s peak, 10 GB/s
     memory, collectives 40 us + 2.5 GB/s): what this kind of machine does, so that
     the plan it runs here is one that pays here
  2. writes the zoo model gpt (small preset: 4 layers, hidden 256, 3.4M parameters)
     to DIR/gpt.onnx
  3. searches the frontier for {SEARCHED} devices (DIR/search.json, plot
     DIR/frontier.png) and says in one sentence what it means
  4. compiles the fastest {DEVICES}-device plan from DIR/search.json to DIR/compiled/
  5. runs 3 training steps on {DEVICES} ranks with --verify against the unpartitioned step
  6. searches {DEVICES} devices again with the memory axes (--axes {MEMORY_AXES}:
     ZeRO, recomputation, micro-batches; DIR/memory-axes.json) and says how far they
     lower the memory per device
  7. compiles that search's least-memory plan to DIR/least-memory/ and runs 3 steps of
     it with --verify, as in 5
and says where everything was written. It takes about half a minute on 2 cores.
--cluster NAME|FILE prices the plans on another profile instead (default: the CPU-class
one above); on h100, for instance, the fastest 2-device plan of this model replicates
all work, and the demo says so.
--json prints, on stdout alone, one document (schema {JSON_SCHEMA}): the written files,
the sentence, and the JSON of each step (model, compile, run).
"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="search, compile and run a small GPT end to end (about half a minute)",
        description="The main job on the zoo's gpt small preset, priced for a CPU-class "
        "machine like the one it runs on.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--dir",
        default="tensoropt-demo",
        help="where to write: a new directory (its parent must exist) or an earlier demo's; "
        "a failed demo removes the directory it made (default ./tensoropt-demo)",
    )
    p.add_argument(
        "--backend",
        choices=["mpi", "local"],
        default="mpi",
        help="mpi: one process per rank (default); local: every rank in this process",
    )
    p.add_argument(
        "--cluster",
        help="price the plans on this profile (v100 | a100 | h100 | h200 | FILE.json) "
        "instead of the CPU-class one written to DIR/cluster.json",
    )
    add_json_flag(p, JSON_SCHEMA)
    p.set_defaults(func=run)


@dataclass(frozen=True, slots=True)
class _Paths:
    model: str
    cluster: str
    search: str
    plot: str
    compiled: str
    axes_search: str
    least_memory: str

    @classmethod
    def under(cls, root: str) -> _Paths:
        join = os.path.join
        return cls(
            join(root, "gpt.onnx"),
            join(root, "cluster.json"),
            join(root, "search.json"),
            join(root, "frontier.png"),
            join(root, "compiled"),
            join(root, "memory-axes.json"),
            join(root, "least-memory"),
        )


def _fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _fmt_mib(count: float) -> str:
    return f"{count / 2**20:.1f} MiB"


def frontier_sentence(doc: dict, devices: int) -> str:
    """What the searched frontier says about ``devices`` devices, in one sentence."""
    per_device = doc["per_device"]
    rows = per_device.get(str(devices), [])
    one = per_device.get("1", [])
    if not rows or not one:
        return f"The search has no frontier at {devices} devices or at 1 device to compare."
    single, fastest, least = one[0], rows[0], rows[-1]
    lowest = f"{_fmt_mib(least['memory_bytes'])} per device at {_fmt_ms(least['time_s'])}"
    if fastest["replicates_all_work"] or fastest["time_s"] >= single["time_s"]:
        return (
            f"No {devices}-device plan is faster than 1 device ({_fmt_ms(single['time_s'])} "
            f"per step): the fastest replicates all work (no faster than 1 device), and "
            f"the others trade step time for memory, down to {lowest}."
        )
    trade = f"trading step time for memory, {devices} devices go down to {lowest}"
    largest = max(int(d) for d, counted in per_device.items() if counted)
    top = per_device[str(largest)][0]
    dp = [r for r in doc["references"] if r["devices"] == devices and r["plan"] == "data-parallel"]
    versus = f" (data-parallel: {_fmt_ms(dp[0]['time_s'])})" if dp else ""
    more = (
        f"; {largest} devices reach {_fmt_ms(top['time_s'])} "
        f"({single['time_s'] / top['time_s']:.1f}x)"
        if largest > devices
        else ""
    )
    return (
        f"Partitioning pays: the fastest {devices}-device plan takes "
        f"{_fmt_ms(fastest['time_s'])} per step{versus} against "
        f"{_fmt_ms(single['time_s'])} on 1 device ({single['time_s'] / fastest['time_s']:.1f}x "
        f"faster) and holds {_fmt_mib(fastest['memory_bytes'])} per device instead of "
        f"{_fmt_mib(single['memory_bytes'])}; {trade}{more}."
    )


def memory_sentence(split: dict, every: dict, devices: int) -> str:
    """How far the memory axes (``every``, a search with them) lower the least memory
    per device at ``devices`` against the split alone (``split``), in one sentence."""
    plain = split["per_device"].get(str(devices), [])
    rows = every["per_device"].get(str(devices), [])
    if not plain or not rows:
        return f"The searches have no frontier at {devices} devices to compare."
    from tensoropt.search.driver import Variant

    before, least = plain[-1], rows[-1]
    variant, blocks = Variant.from_json(least["axes"])
    uses = variant.label(blocks) or "the split alone"  # as the search tables say it
    if least["memory_bytes"] >= before["memory_bytes"]:
        return (
            f"The memory axes do not lower the least memory of {devices} devices: "
            f"{_fmt_mib(before['memory_bytes'])} per device with the split alone."
        )
    return (
        f"With the memory axes, {devices} devices need as little as "
        f"{_fmt_mib(least['memory_bytes'])} per device ({uses}; "
        f"{_fmt_ms(least['time_s'])} per step), against {_fmt_mib(before['memory_bytes'])} "
        f"with the split alone ({_fmt_ms(before['time_s'])}): "
        f"{before['memory_bytes'] / least['memory_bytes']:.1f}x less."
    )


def _say(text: str, out) -> None:
    print(f"\n== {text}", file=out, flush=True)


class _StepFailed(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _step(title: str, argv: list[str], quiet: bool, out) -> dict | None:
    """Run ``tensoropt ARGV``; with ``quiet`` (demo --json) its stdout is its JSON
    document, parsed and returned instead of printed."""
    from tensoropt.cli import main

    _say(f"{title}: tensoropt {' '.join(argv)}", out)
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer) if quiet else contextlib.nullcontext():
        code = main(argv)
    if code != 0:
        print(f"tensoropt demo: step failed: tensoropt {' '.join(argv)}", file=sys.stderr)
        raise _StepFailed(code)
    return json.loads(buffer.getvalue()) if quiet and buffer.getvalue().strip() else None


def _own_entry(name: str) -> bool:
    """Whether ``name`` is what a demo writes in its directory, or a temporary file or
    directory its steps make there and rename into place."""
    return name in _OWN_NAMES or name.startswith(_OWN_PREFIXES)


_OWN_NAMES = frozenset(
    [os.path.basename(getattr(_Paths.under(""), f.name)) for f in fields(_Paths)]
    + ["gpt.onnx.data"]
)
# write_atomic's temp files, compile's temp directories and probes, save_model's temp files
_OWN_PREFIXES = (".tmp-", ".tensoropt-", ".gpt.onnx.")


def _check_dir(path: str) -> bool:
    """Refuse ``--dir`` before anything is written (as `compile -o` and `report -o` refuse
    theirs): its parent must exist, and an existing directory must be empty or hold only
    what a demo writes. Returns whether the directory is yet to be made."""
    from tensoropt.cli.common import check_output_dir
    from tensoropt.errors import OutputDirError

    check_output_dir(path, "--dir")
    if not os.path.exists(path):
        return True
    foreign = sorted(name for name in os.listdir(path) if not _own_entry(name))
    if foreign:
        raise OutputDirError(
            f"--dir {path}: exists and is not a tensoropt demo directory (it holds "
            f"{foreign[0]!r}); choose another --dir or remove it"
        )
    return False


def run(args: argparse.Namespace) -> int:
    if args.cluster is not None:  # a bad profile is refused before anything is written
        from tensoropt.cost.cluster import load_cluster

        load_cluster(args.cluster)
    made = _check_dir(args.dir)
    if made:
        os.mkdir(args.dir)
    done = False
    try:
        code = _run(args)
        done = code == 0
        return code
    except _StepFailed as failed:
        return failed.code
    finally:
        if made and not done:  # a failed demo leaves no directory it made
            shutil.rmtree(args.dir, ignore_errors=True)


def _run(args: argparse.Namespace) -> int:
    from tensoropt.cli.common import write_atomic
    from tensoropt.cli.json_output import document, emit

    quiet = args.json
    out = sys.stderr if quiet else sys.stdout  # with --json, stdout is the document alone
    start = time.perf_counter()
    paths = _Paths.under(args.dir)
    cluster = args.cluster
    if cluster is None:
        _say(f"write a CPU-class cluster profile: {paths.cluster}", out)
        write_atomic(paths.cluster, (json.dumps(CPU_PROFILE, indent=2) + "\n").encode())
        cluster = paths.cluster
    as_json = ["--json"] if quiet else []
    model = _step(
        "write the model",
        ["model", "gpt", "--preset", "small", "-o", paths.model, *as_json],
        quiet,
        out,
    )
    search_argv = ["search", paths.model, "--devices", SEARCHED, "--cluster", cluster]
    search_argv += ["--plot", paths.plot, "--json-out", paths.search]
    with contextlib.redirect_stdout(out):  # the search's tables, on stderr for --json
        _step(f"search devices {SEARCHED}", search_argv, False, out)
    with open(paths.search, encoding="utf-8") as f:
        sentence = frontier_sentence(json.load(f), DEVICES)
    _say(f"what the frontier says: {sentence}", out)
    compiled = _step(
        f"compile the fastest {DEVICES}-device plan",
        [
            "compile",
            paths.model,
            "--devices",
            str(DEVICES),
            "--pick",
            "fastest",
            "--search",
            paths.search,
            "--cluster",
            cluster,
            "-o",
            paths.compiled,
            *as_json,
        ],
        quiet,
        out,
    )
    how = f"{DEVICES} processes" if args.backend == "mpi" else "one process"
    ran = _step(
        f"run 3 steps on {DEVICES} ranks ({args.backend}: {how}) and verify against one device",
        ["run", paths.compiled, "--steps", "3", "--backend", args.backend, "--verify", *as_json],
        quiet,
        out,
    )
    axes_argv = ["search", paths.model, "--devices", str(DEVICES), "--cluster", cluster]
    axes_argv += ["--axes", MEMORY_AXES, "--json-out", paths.axes_search]
    with contextlib.redirect_stdout(out):
        _step(f"search {DEVICES} devices with the memory axes", axes_argv, False, out)
    with open(paths.search, encoding="utf-8") as f, open(paths.axes_search, encoding="utf-8") as g:
        trade = memory_sentence(json.load(f), json.load(g), DEVICES)
    _say(f"what the memory axes buy: {trade}", out)
    least_compiled = _step(
        f"compile the least-memory {DEVICES}-device plan",
        [
            "compile",
            paths.model,
            "--devices",
            str(DEVICES),
            "--pick",
            "min-memory",
            "--search",
            paths.axes_search,
            "--cluster",
            cluster,
            "-o",
            paths.least_memory,
            *as_json,
        ],
        quiet,
        out,
    )
    least_ran = _step(
        f"run 3 steps of it on {DEVICES} ranks and verify against one device",
        ["run", paths.least_memory, "--steps", "3", "--backend", args.backend, "--verify",
         *as_json],
        quiet,
        out,
    )  # fmt: skip
    elapsed = time.perf_counter() - start
    written = {
        "model": paths.model,
        "cluster": cluster,
        "search": paths.search,
        "plot": paths.plot,
        "compiled": paths.compiled,
        "axes_search": paths.axes_search,
        "least_memory": paths.least_memory,
    }
    if quiet:
        body = {
            "dir": args.dir,
            "seconds": elapsed,
            "devices": DEVICES,
            "frontier": sentence,
            "written": written,
            "model": model,
            "compile": compiled,
            "run": ran,
            "memory_axes": {"sentence": trade, "compile": least_compiled, "run": least_ran},
        }
        emit(args, document(JSON_SCHEMA, body))
        return 0
    _say(f"done in {elapsed:.0f} s; written:", out)
    what = {
        "model": "the model (ONNX)",
        "cluster": "the cluster profile the plans are priced on",
        "search": "every frontier point (plans as strategy indices: compile --search)",
        "plot": "the frontier plot",
        "compiled": "one training-step graph per device, plan.json, manifest.json",
        "axes_search": f"the frontier of {DEVICES} devices with the memory axes",
        "least_memory": "its least-memory plan, compiled",
    }
    for key, path in written.items():
        print(f"  {path:<40} {what[key]}", file=out)
    print(
        f"  inspect the compiled graphs: tensoropt inspect {paths.compiled} (or "
        f"{paths.least_memory})",
        file=out,
    )
    return 0
