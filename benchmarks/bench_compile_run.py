"""Data parallelism on 2 ranks against 1 rank for the zoo ``gpt`` small preset, on the
local and mpi backends, plus compile time per rank count; all in the same run.

1. compile: ``tensoropt compile gpt.onnx --devices N --plan data-parallel`` in this
   process (import, training step, partition, write), N = 1, 2, 4.
2. steps/s: ``run_steps`` over the compiled directories; the time is the runtime's own
   step loop (session creation and MPI launch excluded; they are reported apart as
   the wall time of the whole call). 1 rank vs 2 ranks on the same global batch, local
   (lockstep, one process) and mpi (one process per rank), measured alternately.

The machine has 2 cores: 2 MPI ranks get 1 onnxruntime thread each, 1 rank gets 2.

Usage: python benchmarks/bench_compile_run.py [--steps N] [--repeats R] [--write]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from results import write_section  # noqa: E402  (benchmarks/ is on sys.path)

RESULTS = Path(__file__).with_name("RESULTS.md")
SECTION = "## Sharded runs"


def compile_once(model: Path, devices: int, outdir: Path) -> float:
    from tensoropt.cli import main

    argv = ["compile", str(model), "--devices", str(devices), "--plan", "data-parallel"]
    sink = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        code = main([*argv, "-o", str(outdir)])
    if code != 0:
        raise SystemExit(f"compile failed: {sink.getvalue()}")
    return time.perf_counter() - t0


def run_once(outdir: Path, steps: int, backend: str) -> tuple[float, float, list[float]]:
    """(seconds per step inside the step loop, wall seconds of the call, losses)."""
    from tensoropt.runtime.run import run_steps

    t0 = time.perf_counter()
    result = run_steps(outdir, steps, backend=backend)
    return result.seconds / steps, time.perf_counter() - t0, result.losses


def paired(fn_a, fn_b, repeats: int):
    """Alternate a and b; medians of each and of the per-pair ratios a/b."""
    a_all, b_all, ratios = [], [], []
    for i in range(repeats):
        if i % 2:
            b, a = fn_b(), fn_a()
        else:
            a, b = fn_a(), fn_b()
        a_all.append(a)
        b_all.append(b)
        ratios.append(a[0] / b[0])
    return a_all, b_all, statistics.median(ratios)


def _med(results, k: int) -> float:
    return statistics.median(r[k] for r in results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--write", action="store_true", help=f"update '{SECTION}' in RESULTS.md")
    args = ap.parse_args()

    from tensoropt.models import build_model, preset_config, save_model, zoo_info

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_path = tmp / "gpt.onnx"
        model = build_model("gpt", "small")
        save_model(model, str(model_path))
        info = zoo_info(model)
        cfg = preset_config("gpt", "small")
        compile_rows = []
        outdirs = {}
        for devices in (1, 2, 4):
            times = []
            for r in range(args.repeats):
                out = tmp / f"dp{devices}_{r}"
                times.append(compile_once(model_path, devices, out))
            outdirs[devices] = tmp / f"dp{devices}_0"
            compile_rows.append((devices, statistics.median(times), min(times)))
        runs = {}
        for backend in ("local", "mpi"):
            two, one, ratio = paired(
                lambda b=backend: run_once(outdirs[2], args.steps, b),
                lambda b=backend: run_once(outdirs[1], args.steps, b),
                args.repeats,
            )
            runs[backend] = (one, two, ratio)
        # local and mpi give bit-identical losses for the same rank count; 2 ranks sum
        # the gradient in another order than 1 rank, so they agree to float32 rounding
        same = all(r[2] == runs["local"][i][0][2] for b in runs for i in (0, 1) for r in runs[b][i])
        drift = max(
            abs(a - b) / abs(b)
            for a, b in zip(runs["local"][1][0][2], runs["local"][0][0][2], strict=True)
        )

    load = os.getloadavg()[0]
    lines = [
        SECTION,
        "",
        f"`python benchmarks/bench_compile_run.py --steps {args.steps} --repeats {args.repeats}` "
        f"-- {datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.machine()}, {os.cpu_count()} "
        f"cores, Python {platform.python_version()}, load average {load:.1f} at the end. "
        f"zoo gpt small preset ({cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, "
        f"batch {cfg.batch}, seq {cfg.seq}, vocab {cfg.vocab}; {info.params:,} parameters), "
        "SGD with momentum, data-parallel plan; medians over the repeats, measured alternately.",
        "",
        "(a) compile (import + training step + partition + write), in process",
        "",
        "| ranks | compile s (median) | min s | / 1 rank |",
        "|---:|---:|---:|---:|",
    ]
    base = compile_rows[0][1]
    for devices, med, low in compile_rows:
        lines.append(f"| {devices} | {med:.2f} | {low:.2f} | {med / base:.2f} |")
    lines += [
        "",
        "(b) training steps (step loop only; 'call s': the whole run_steps call, with "
        "sessions and launch)",
        "",
        "| backend | ranks | ms/step | steps/s | call s | 2 ranks / 1 rank (time) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for backend, (one, two, ratio) in runs.items():
        for ranks, res, shown in ((1, one, ""), (2, two, f"{ratio:.2f}")):
            ms = 1000 * _med(res, 0)
            call = _med(res, 1)
            lines.append(
                f"| {backend} | {ranks} | {ms:.1f} | {1000 / ms:.1f} | {call:.2f} | {shown} |"
            )
    lines += [
        "",
        f"losses: local == mpi bit for bit at each rank count: {'yes' if same else 'NO'}; "
        f"2 ranks vs 1 rank: max relative difference {drift:.1e}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
