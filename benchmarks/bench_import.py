"""Import plus training-step construction of a GPT-2-small-size model: wall time and
peak memory, against baselines measured in the same run.

The model is the zoo ``gpt`` at GPT-2 small size (12 layers, hidden 768, 12 heads,
vocab 50304, sequence 1024 by default; its weights are zeros in a sparse
``.onnx.data`` file, as for every zoo model above 64 MiB). It is saved to a temporary
file first; then each stage runs in a fresh Python process, so that the peak RSS
(``VmHWM``) belongs to that stage alone:

  python      interpreter + imports of onnx, onnx_ir and tensoropt (nothing loaded)
  load        ``onnx.load`` with the weights (the floor any importer pays)
  load+infer  ``onnx.load`` + ``onnx.shape_inference.infer_shapes(data_prop=True)`` on
              the full model (what the importer did before its shape-only inference)
  import      ``tensoropt.ir.importer.import_model``
  import+step ``import_model`` + ``build_training_step`` (SGD with momentum): the target
  old import+step  the same with shape inference over the full weights in both passes
              (the code before this benchmark's fix, re-enabled by monkeypatching)

Target: import+step < 10 s on this 2-core machine. Ratios are against ``load``.

Usage: python benchmarks/bench_import.py [--seq N] [--repeats R] [--profile] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from results import write_section  # noqa: E402  (benchmarks/ is on sys.path)

RESULTS = Path(__file__).with_name("RESULTS.md")
SECTION = "## Import and training step"
TARGET_S = 10.0

_CHILD = textwrap.dedent(
    """
    import json, sys, time
    import onnx, onnx_ir
    from tensoropt.cli.common import supported_ops
    from tensoropt.ir.importer import ImportOptions, import_model
    from tensoropt.passes.training_step import TrainingOptions, build_training_step
    from tensoropt.rules.grad import GRAD_RULES

    stage, path = sys.argv[1], sys.argv[2]
    t0 = time.perf_counter()
    if stage == "load":
        onnx.load(path)
    elif stage == "load+infer":
        onnx.shape_inference.infer_shapes(onnx.load(path), strict_mode=False, data_prop=True)
    elif stage in ("import", "import+step", "old import+step"):
        if stage == "old import+step":  # shape inference over the weights, as before
            import tensoropt.ir.importer as importer
            import tensoropt.passes.training_step as training_step

            importer.without_large_weights = lambda model: model
            training_step._detach_large_weights = lambda graph: {}
        model = import_model(path, ImportOptions(supported_ops=supported_ops(GRAD_RULES)))
        if stage != "import":
            build_training_step(model, TrainingOptions())
    wall = time.perf_counter() - t0
    # VmHWM, not ru_maxrss: Linux carries the parent's high-water mark across exec
    hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    rss = int(hwm.split()[1]) * 1024
    print(json.dumps({"wall": wall, "rss": rss}))
    """
)
NOTE = (
    "Why the old path missed the target (cProfile, 2026-11-30): the training-step pass "
    "serialized the whole step model with its weights and momentum buffers for "
    "`onnx.shape_inference.infer_shapes` (16.6 s, of which `SerializeToString` 7.6 s) and "
    "parsed the result back; the importer did the same over the forward weights (2.9 s). "
    "Both now run inference on a copy whose float initializers above 64 KiB are "
    "data-free external references (`importer.without_large_weights`, "
    "`training_step._detach_large_weights`); large float tensors are never shape "
    "operands. The remaining top costs of import+step are reading the external data "
    "(0.44 s), onnx_ir's tensor-to-numpy (0.15 s), runtime-checkable Protocol "
    "isinstance checks in onnx_ir (0.14 s) and the trainable policy's mask scan of "
    "every float initializer (`trainable._is_mask`, 0.2 s)."
)
STAGES = ("python", "load", "load+infer", "import", "import+step", "old import+step")


def build(path: Path, seq: int) -> dict:
    from tensoropt.models import build_model, save_model, zoo_info

    model = build_model("gpt", "small", layers=12, hidden=768, heads=12, seq=seq, vocab=50304)
    save_model(model, str(path))
    info = zoo_info(model)
    return {"params": info.params, "nodes": len(model.graph.node)}


def measure(stage: str, path: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, stage, str(path)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def profile(path: Path, top: int = 15) -> str:
    import cProfile
    import io
    import pstats

    from tensoropt.cli.common import supported_ops
    from tensoropt.ir.importer import ImportOptions, import_model
    from tensoropt.passes.training_step import TrainingOptions, build_training_step
    from tensoropt.rules.grad import GRAD_RULES

    prof = cProfile.Profile()
    prof.enable()
    model = import_model(path, ImportOptions(supported_ops=supported_ops(GRAD_RULES)))
    build_training_step(model, TrainingOptions())
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def table(results: dict[str, list[dict]]) -> list[str]:
    base = statistics.median(r["wall"] for r in results["load"])
    lines = [
        "| stage | wall s (median) | min s | peak RSS MiB | wall / load |",
        "|---|---:|---:|---:|---:|",
    ]
    for stage in STAGES:
        walls = [r["wall"] for r in results[stage]]
        rss = max(r["rss"] for r in results[stage]) / 2**20
        if stage == "python":
            lines.append(f"| python + imports only | - | - | {rss:.0f} | |")
            continue
        ratio = f"{statistics.median(walls) / base:.2f}"
        lines.append(
            f"| {stage} | {statistics.median(walls):.2f} | {min(walls):.2f} | {rss:.0f} | {ratio} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=1024, help="sequence length (default 1024)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of import+step")
    ap.add_argument("--write", action="store_true", help=f"update '{SECTION}' in RESULTS.md")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpt2_small.onnx"
        info = build(path, args.seq)
        data = path.with_name(path.name + ".data")
        results: dict[str, list[dict]] = {s: [] for s in STAGES}
        for _ in range(args.repeats):
            for stage in STAGES:  # interleaved, so background load hits every stage alike
                results[stage].append(measure(stage, path))
        prof = profile(path) if args.profile else ""
        weights_mib = data.stat().st_size / 2**20 if data.exists() else 0.0
    total = statistics.median(r["wall"] for r in results["import+step"])
    verdict = "meets" if total < TARGET_S else "MISSES"
    load = os.getloadavg()[0]
    header = (
        f"`python benchmarks/bench_import.py --seq {args.seq}` -- "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, load average {load:.1f} at the end. "
        f"zoo gpt at GPT-2 small size: 12 layers, hidden 768, 12 heads, vocab 50304, "
        f"seq {args.seq}, {info['params']:,} parameters ({weights_mib:.0f} MiB of float32 "
        f"weights, zeros in a sparse .data file), {info['nodes']} forward nodes; "
        f"{args.repeats} interleaved repeats, each stage in a fresh process."
    )
    lines = [SECTION, "", header, "", *table(results), ""]
    old = statistics.median(r["wall"] for r in results["old import+step"])
    old_rss = max(r["rss"] for r in results["old import+step"]) / 2**20
    new_rss = max(r["rss"] for r in results["import+step"]) / 2**20
    lines.append(
        f"import+step: {total:.2f} s, {verdict} the target of < {TARGET_S:.0f} s; "
        f"{old / total:.1f}x faster and {old_rss / new_rss:.1f}x less peak memory than "
        "shape inference over the full weights (old import+step)."
    )
    lines += ["", NOTE]
    text = "\n".join(lines) + "\n"
    print(text)
    if prof:
        print(prof)
    if args.write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
