"""The runtime at scale: GPT-2-medium-shaped runs, and how segments share constants.

``scale`` (the default): zoo ``gpt --preset paper --layers 24 --hidden 1024 --heads 16``
(batch 2 and sequence 64 by default, with ``--batch``/``--seq``: the weights are what
is big; a batch of 1 would not split, and data parallelism would replicate it). The
zoo writes a paper preset's weights as zeros; with them both verified steps had the
same loss and both sides the same parameters, a comparison of nothing, so the
benchmark first fills every float weight with N(0, 0.02) noise in place. Compiled for 2 devices with
data-parallel and megatron (SGD, ``--momentum`` 0 by default: without a momentum state
the verified run of data parallelism fits this machine's 24 GB next to other work),
then for each:

1. ``tensoropt run OUT --steps 2 --backend mpi --verify``: must pass;
2. ``tensoropt run OUT --steps 2 --backend mpi --profile --profile-warmup 1``: each
   rank's measured peak memory (anonymous RSS growth, runtime/profiling.py) against the
   plan's estimate (the cost model's memory per device, which compile keeps in
   manifest.json and ``tensoropt inspect`` reports; the static liveness peak of the
   device graph is shown beside it); the target is within 1.3x.

``constants``: the two ways a rank's compute segments can share a constant (an
initializer that is neither fed nor trained, e.g. a frozen weight read by the forward
and the backward segment) from one array per rank: feed it as an input to every
segment that reads it (the runtime's way), or hand it to each session as an
initializer with ``SessionOptions.add_external_initializers``. Zoo ``gpt --preset
small`` with every MLP weight frozen, megatron on 2 ranks, local backend, one
process: session creation time and memory, median step time and step memory growth,
alternated.

Usage: python benchmarks/bench_scale_run.py [scale|constants] [--write]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import onnx
from results import write_section  # noqa: E402  (benchmarks/ is on sys.path)

SECTION = "## Runtime at scale"
MODEL = ["--preset", "paper", "--layers", "24", "--hidden", "1024", "--heads", "16"]


def _cli(*argv: str, capture: bool = True) -> str:
    cmd = [sys.executable, "-m", "tensoropt", *argv]
    proc = subprocess.run(cmd, capture_output=capture, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc.stdout


def update_size(model: Path, saved: Path) -> float:
    """How far 2 steps moved the weights: max over tensors of max|after - before| over
    the model's largest weight magnitude (what the verify tolerance is measured against:
    a change below float32 rounding of the weights would make the comparison blind)."""
    import numpy as np

    from tensoropt.runtime.external import load_graph, read_initializer

    before = {t.name: t for t in load_graph(model).graph.initializer}
    moved, scale = 0.0, 0.0
    with np.load(saved) as after:
        for name in after.files:
            old = read_initializer(before[name], model.parent)
            moved = max(moved, float(np.max(np.abs(after[name] - old))))
            scale = max(scale, float(np.max(np.abs(old))))
    return moved / scale


def randomize(model: Path, seed: int = 0, chunk: int = 1 << 24) -> int:
    """Fill every float external initializer of ``model`` with N(0, 0.02), in place."""
    import numpy as np

    from tensoropt.runtime.external import external_ref, load_graph

    rng = np.random.default_rng(seed)
    proto = load_graph(model)
    count = 0
    for t in proto.graph.initializer:
        ref = external_ref(t)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
        if ref is None or dtype != np.float32:
            continue
        n = int(np.prod(t.dims, dtype=np.int64))
        with (model.parent / ref.location).open("r+b") as f:
            f.seek(ref.offset)
            for start in range(0, n, chunk):
                part = rng.standard_normal(min(chunk, n - start), dtype=np.float32) * 0.02
                f.write(part.tobytes())
        count += n
    return count


class _Peak:
    """The machine's largest used memory while it runs (sampled every 0.5 s)."""

    def __init__(self) -> None:
        import threading

        self.base = self.peak = _used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, _used())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak - self.base


def _used() -> int:
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    kib = {k: int(v.split()[0]) for k, v in info.items() if k in ("MemTotal", "MemAvailable")}
    return (kib["MemTotal"] - kib["MemAvailable"]) * 1024


def scale(args: argparse.Namespace) -> str:
    work = Path(tempfile.mkdtemp(prefix="bench-scale-run-", dir=args.dir))
    model = work / "med.onnx"
    knobs = [*MODEL, "--batch", str(args.batch), "--seq", str(args.seq)]
    print(_cli("model", "gpt", *knobs, "-o", str(model)).strip(), flush=True)
    filled = randomize(model)
    print(f"filled {filled:,} weights with noise", flush=True)
    train = ["--optimizer", "sgd", "--momentum", str(args.momentum), "--lr", str(args.lr)]
    rows = []
    for plan in ("data-parallel", "megatron"):
        out = work / plan
        t0 = time.perf_counter()
        _cli("compile", str(model), "--devices", "2", "--plan", plan, *train, "-o", str(out))
        compile_s = time.perf_counter() - t0
        sizes = {p.name: p.stat().st_size for p in out.iterdir()}
        inspect = json.loads(_cli("inspect", str(out), "--json"))
        estimates = [inspect["estimate"]["memory_bytes"]] * len(inspect["devices"])
        liveness = [d["liveness_peak_bytes"] for d in inspect["devices"]]
        t0 = time.perf_counter()
        peak = _Peak()
        saved = work / "params.npz"
        verify = json.loads(
            _cli(
                "run", str(out), "--steps", "2", "--backend", "mpi", "--verify", "--json",
                "--save-params", str(saved),
            )
        )  # fmt: skip
        verify_used = peak.stop()
        moved = update_size(model, saved)
        saved.unlink()
        verify_s = time.perf_counter() - t0
        peak = _Peak()
        prof = json.loads(
            _cli(
                "run", str(out), "--steps", "2", "--backend", "mpi", "--profile",
                "--profile-warmup", "1", "--json",
            )
        )  # fmt: skip
        profile_used = peak.stop()
        measured = [r["memory_bytes"] for r in prof["profile"]["ranks"]]
        rows.append(
            {
                "plan": plan,
                "compile_s": compile_s,
                "data_bytes": [sizes.get(f"device_{r}.data", 0) for r in range(2)],
                "verify_ok": verify["verify"]["ok"],
                "max_rel_error_loss": verify["verify"]["max_rel_error_loss"],
                "max_rel_error_params": verify["verify"]["max_rel_error_params"],
                "losses": verify["losses"],
                "verify_s": verify_s,
                "verify_used": verify_used,
                "moved": moved,
                "profile_used": profile_used,
                "estimate_bytes": estimates,
                "liveness_bytes": liveness,
                "measured_bytes": measured,
                "ratio": [m / e for m, e in zip(measured, estimates, strict=True)],
                "step_s": [r["step_s"] for r in prof["profile"]["ranks"]],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        if not args.keep:
            shutil.rmtree(out)
    if not args.keep:
        shutil.rmtree(work)
    gib = 2**30
    lines = [
        "### GPT-2-medium shape on 2 ranks (mpi backend)",
        "",
        f"{_stamp()}. `python benchmarks/bench_scale_run.py scale`: `tensoropt model gpt "
        f"{' '.join(knobs)}` ({filled:,} weights, filled with N(0, 0.02) noise), compiled "
        f"for 2 devices (`{' '.join(train)}`), then `run --steps 2 --backend mpi --verify` "
        "and `run --steps 2 --backend mpi --profile --profile-warmup 1` (the second step "
        "measured). Estimate: the plan's memory per device from the cost model (the figure "
        "search, compile and `tensoropt inspect` report); liveness: the static liveness "
        "peak of the rank's device graph; measured: the rank's anonymous RSS growth over the step "
        "loop (`run --profile`). Machine memory: the largest growth of the machine's used "
        "memory during each run (all processes of the run; rank 0 also holds the "
        "unpartitioned reference while verifying). Update: how far the 2 steps moved the "
        "weights, max|after - before| over the largest weight, the scale the parameter "
        "errors are measured on (`--lr` is large so that it stands far above float32 "
        "rounding). Step time on a machine shared with other work.",
        "",
        "| plan | rank | data file GiB | verify: loss / params rel. err. (update) "
        "| estimate GiB | liveness GiB | measured GiB | measured / estimate | step s "
        "| machine memory GiB (verify, profile) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for r in range(2):
            verdict = "ok" if row["verify_ok"] else "FAILED"
            lines.append(
                f"| {row['plan']} | {r} | {row['data_bytes'][r] / gib:.2f} | {verdict} "
                f"{row['max_rel_error_loss']:.1e} / {row['max_rel_error_params']:.1e} "
                f"({row['moved']:.1e}) | {row['estimate_bytes'][r] / gib:.2f} "
                f"| {row['liveness_bytes'][r] / gib:.2f} "
                f"| {row['measured_bytes'][r] / gib:.2f} "
                f"| {row['ratio'][r]:.2f} | {row['step_s'][r]:.1f} "
                f"| {row['verify_used'] / gib:.1f}, {row['profile_used'] / gib:.1f} |"
            )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ constants


def _stub(name: str, data_type: int, dims) -> onnx.TensorProto:
    """A bytes-free external initializer that a session gets from memory."""
    from onnx import TensorProto

    out = TensorProto(name=name, data_type=data_type, dims=list(dims))
    out.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "shared"), ("offset", "0")):
        entry = out.external_data.add()
        entry.key, entry.value = key, value
    return out


def _as_initializers(plan):
    """``plan`` with every shared constant a stub initializer of its segments instead."""
    from tensoropt.runtime.split import SplitPlan

    stages = []
    for stage in plan.stages:
        seg = stage.segment
        if seg is None or not seg.shared:
            stages.append(stage)
            continue
        model = onnx.ModelProto()
        model.CopyFrom(seg.model)
        inputs = [i for i in model.graph.input if i.name not in seg.shared]
        for name in seg.shared:
            array = plan.weights[name]
            dtype = onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
            model.graph.initializer.append(_stub(name, dtype, array.shape))
        del model.graph.input[:]
        model.graph.input.extend(inputs)
        kept = tuple(n for n in seg.inputs if n not in seg.shared)
        new = dataclasses.replace(seg, model=model, inputs=kept)
        stages.append(dataclasses.replace(stage, segment=new))
    new = SplitPlan(plan.rank, tuple(stages), plan.feeds, plan.outputs, plan.constants, {})
    _ORIGINAL[id(new)] = plan
    return new


_ORIGINAL: dict = {}  # id(plan from _as_initializers) -> the plan it came from


class _InitializerProgram:
    """RankProgram whose sessions get the shared constants as external initializers."""

    def __new__(cls, plan, config):
        import onnxruntime as ort

        from tensoropt.runtime.program import RankProgram

        original = _ORIGINAL[id(plan)]
        program = RankProgram.__new__(RankProgram)
        program.plan, program.clock = plan, None
        values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in original.weights.items()}
        program._keep = (original, values)
        program._sessions = []
        for stage in plan.stages:
            seg = stage.segment
            if seg is None:
                program._sessions.append(None)
                continue
            opts = config.options()
            names = [n for n in seg.shared]
            if names:
                opts.add_external_initializers(names, [values[n] for n in names])
            program._sessions.append(
                ort.InferenceSession(
                    seg.model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
                )
            )
        return program


def _constants_once(outdir: Path, as_initializers: bool, steps: int) -> dict:
    from tensoropt.runtime.driver import RunOptions, drive
    from tensoropt.runtime.engine import LocalEngine, load_device, split_all
    from tensoropt.runtime.manifest import load_outdir
    from tensoropt.runtime.profiling import _libc_trim, anon_rss_bytes
    from tensoropt.runtime.program import SessionConfig

    _libc_trim()
    rss0 = anon_rss_bytes()
    manifest = load_outdir(outdir)
    models = {r: load_device(manifest, r) for r in range(manifest.world_size)}
    plans = split_all(manifest, models)
    t0 = time.perf_counter()
    if as_initializers:
        from tensoropt.runtime import engine as engine_module

        stubbed = {r: _as_initializers(p) for r, p in plans.items()}
        original = engine_module.RankProgram
        engine_module.RankProgram = _InitializerProgram
        try:
            engine = LocalEngine(stubbed, SessionConfig(intra_op_threads=1))
        finally:
            engine_module.RankProgram = original
    else:
        engine = LocalEngine(plans, SessionConfig(intra_op_threads=1))
    build_s = time.perf_counter() - t0
    _libc_trim()
    built = anon_rss_bytes() - rss0
    opts = RunOptions(steps=steps, profile=True, profile_warmup=2, threads=1)
    result = drive(engine, manifest, models, opts)
    prof = result.profile.ranks[0]
    shared = sum(a.nbytes for p in plans.values() for a in p.weights.values())
    return {
        "build_s": build_s,
        "built": built,
        "step_s": prof.step_s,
        "cpu_s": sum(r.compute_cpu_s for r in result.profile.ranks),
        "memory": prof.memory_bytes,
        "shared_bytes": shared,
        "losses": result.losses,
    }


def constants(args: argparse.Namespace) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tensoropt.models import build_model
    from tensoropt.passes.training_step import TrainingOptions
    from tests.helpers.compile import compile_model

    work = Path(tempfile.mkdtemp(prefix="bench-constants-", dir=args.dir))
    options = TrainingOptions(freeze=r"mlp\.")
    compile_model(build_model("gpt", "small"), "megatron", "2", work / "out", options)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.repeats):
        for as_initializers in (False, True):
            runs[as_initializers].append(_constants_once(work / "out", as_initializers, args.steps))
    shutil.rmtree(work)
    a, b = runs[False][0]["losses"], runs[True][0]["losses"]
    loss_diff = max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
    keys = ("build_s", "built", "step_s", "cpu_s", "memory")
    med = {
        feed: {k: statistics.median(r[k] for r in rs) for k in keys} for feed, rs in runs.items()
    }
    mib = 2**20
    shared = runs[False][0]["shared_bytes"] / mib
    lines = [
        "### Sharing a rank's constants between its segments",
        "",
        f"{_stamp()}. `python benchmarks/bench_scale_run.py constants`: zoo gpt small with "
        f"every MLP weight frozen (constants: {shared:.1f} MiB over both ranks), megatron "
        f"on 2 ranks, local backend, 1 thread. Sessions built: time and anonymous memory "
        "from before loading the graphs to after creating every session (constants "
        "included); step: wall time, and the segments' CPU time summed over both ranks "
        "(what other processes on the machine do not inflate); step memory: `run "
        "--profile`'s growth over the step loop. Medians of "
        f"{args.repeats} alternated runs "
        f"of {args.steps} steps (2 warm-up). Largest relative difference of their losses: "
        f"{loss_diff:.1e} (onnxruntime optimizes a graph with constant weights differently).",
        "",
        "| constants reach the sessions as | sessions built: s, MiB | step ms "
        "| compute CPU ms | step memory MiB |",
        "|---|---|---|---|---|",
    ]
    labels = ((False, "inputs fed each step (runtime)"), (True, "add_external_initializers"))
    for feed, label in labels:
        m = med[feed]
        lines.append(
            f"| {label} | {m['build_s']:.2f}, {m['built'] / mib:.1f} | {m['step_s'] * 1e3:.1f} "
            f"| {m['cpu_s'] * 1e3:.1f} | {m['memory'] / mib:.1f} |"
        )
    return "\n".join(lines) + "\n"


def _stamp() -> str:
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return f"{now}, {platform.machine()}, {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=["scale", "constants"], default="scale")
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    parser.add_argument("--batch", type=int, default=2, help="2: data parallelism splits it")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (scale)")
    parser.add_argument("--lr", type=float, default=1.0, help="SGD learning rate (scale)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the models (default: tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the compiled directories")
    args = parser.parse_args()
    text = scale(args) if args.what == "scale" else constants(args)
    print(text)
    if args.write:
        sub = text.splitlines()[0]
        write_section(SECTION, text, subsection=sub)


if __name__ == "__main__":
    main()
