"""Runtime overhead and scaling, measured against baselines in the same run.

1. Executor overhead: a 1-device output directory run through the runtime
   (split plan, driver, carry) vs a bare onnxruntime session looping over the same
   training-step graph with the same batches. Target: ratio <= 1.10.
2. Data parallel: the same global batch on 2 ranks (local lockstep and MPI) vs 1 rank.

Usage: python benchmarks/bench_runtime.py [--steps N] [--batch B] [--no-mpi] [--no-write]
Prints ratios and replaces/appends the "## Runtime" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import numpy_helper

from tensoropt.runtime.data import make_batch, specs_from_manifest
from tensoropt.runtime.manifest import load_outdir
from tensoropt.runtime.run import run_steps

# the hand-built cases are test helpers: the repository root makes ``tests`` importable
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers.handbuilt import mlp_case, write_outdir  # noqa: E402

RESULTS = Path(__file__).with_name("RESULTS.md")


def bare_ort(outdir: Path, steps: int, seed: int) -> float:
    """Seconds per step of a plain session loop over device_0.onnx (no runtime code)."""
    import onnx

    manifest = load_outdir(outdir)
    model = onnx.load(str(outdir / "device_0.onnx"))
    names = set(manifest.step["params"]) | set(manifest.step["states"])
    state = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name in names}
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    outs = [o.name for o in sess.get_outputs()]
    carry = manifest.carry
    specs = specs_from_manifest(manifest)
    t0 = time.perf_counter()
    for k in range(steps):
        batch = make_batch(specs, k, seed)
        result = dict(zip(outs, sess.run(outs, {**batch, **state}), strict=True))
        state = {carry[o]: result[o] for o in carry}
    return (time.perf_counter() - t0) / steps


def runtime(outdir: Path, steps: int, seed: int, backend: str = "local") -> float:
    """Seconds per step inside the runtime's driver (session creation excluded)."""
    return run_steps(outdir, steps, backend=backend, seed=seed).seconds / steps


def paired(fn_a, fn_b, repeats: int) -> tuple[float, float, float]:
    """Median times of a and b and the median of the per-repeat ratios a/b.

    The two are measured alternately (a b, b a, a b, ...) so that background load
    on a shared machine hits both alike.
    """
    a_times, b_times, ratios = [], [], []
    for i in range(repeats):
        if i % 2:
            b, a = fn_b(), fn_a()
        else:
            a, b = fn_a(), fn_b()
        a_times.append(a)
        b_times.append(b)
        ratios.append(a / b)
    return statistics.median(a_times), statistics.median(b_times), statistics.median(ratios)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--h", type=int, default=2048)
    ap.add_argument("--no-mpi", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    dims = {"batch": args.batch, "d": args.d, "h": args.h}
    tmp = Path(tempfile.mkdtemp(prefix="bench-runtime-"))
    one = write_outdir(mlp_case(1, 1, **dims), tmp / "one")
    dp2 = write_outdir(mlp_case(2, 1, **dims), tmp / "dp2")
    run_steps(one, 2)  # warm caches (imports, allocator)

    rows = []
    r = args.repeats
    ours, bare, ratio = paired(
        lambda: runtime(one, args.steps, 0), lambda: bare_ort(one, args.steps, 0), r
    )
    rows.append(("1 device: runtime / bare onnxruntime", ours, bare, ratio, "<= 1.10"))
    local2, one_b, ratio = paired(
        lambda: runtime(dp2, args.steps, 0), lambda: runtime(one, args.steps, 0), r
    )
    rows.append(("DP 2 ranks local (lockstep) / 1 rank", local2, one_b, ratio, "info"))
    if not args.no_mpi:
        mpi2, one_c, ratio = paired(
            lambda: runtime(dp2, args.steps, 0, "mpi"), lambda: runtime(one, args.steps, 0), r
        )
        rows.append(("DP 2 ranks mpi / 1 rank", mpi2, one_c, ratio, "< 1 with >= 2 free cores"))
    lines = _report(rows, args, dims)
    print("\n".join(lines))
    if not args.no_write:
        _write_section(lines)


def _report(rows, args, dims) -> list[str]:
    lines = [
        "## Runtime",
        "",
        f"`python benchmarks/bench_runtime.py` -- {time.strftime('%Y-%m-%d')}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f} at the end (shared machine), "
        f"onnxruntime {ort.__version__}. Hand-built MLP step (batch {dims['batch']}, "
        f"d {dims['d']}, h {dims['h']}, SGD momentum), {args.steps} steps, median of "
        f"{args.repeats} alternating pairs (ratio = median of per-pair ratios); time per "
        "step excludes session creation.",
        "",
        "| measurement | ms/step | baseline ms/step | ratio | target |",
        "|---|---:|---:|---:|---|",
    ]
    for name, value, base, ratio, target in rows:
        lines.append(f"| {name} | {value * 1e3:.2f} | {base * 1e3:.2f} | {ratio:.3f} | {target} |")
    return lines


def _write_section(lines: list[str]) -> None:
    """Replace this benchmark's section of RESULTS.md, or append it; leave others alone."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    section = "\n".join(lines) + "\n"
    start = text.find("## Runtime\n")
    if start < 0:
        RESULTS.write_text(text.rstrip("\n") + "\n\n" + section)
        return
    end = text.find("\n## ", start + 1)
    rest = "" if end < 0 else text[end + 1 :]
    RESULTS.write_text(text[:start] + section + ("\n" + rest if rest else ""))


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
