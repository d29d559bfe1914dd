"""The memory estimate term by term against the measured growth of a rank's memory.

For the plans `tensoropt validate` measures (frontier points of each model at 1 and 2
devices, split axis only), each plan's estimate is read off the cost model in three
terms, and the plan is run with `run --profile` (mpi backend):

- B: the parameters and optimizer states as the step holds them (in and ``__new``);
- G: the gradients (one per placed parameter shard);
- A: the rest: saved activations and the conversion buffers the backward reads.

The estimate is B + A + G (a sum of unit entries, as the search needs); the table
shows what the measured growth X leaves over B, and the median error of the estimate
and of max(A, G) in place of A + G, which is the peak of one pool where the backward
frees activations while it makes gradients (docs/design/measured.md, "Left out").

Usage: python benchmarks/bench_memory_terms.py --cluster FILE.json [--models LIST]
       [--optimizer sgd|adam] [--points K] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
from pathlib import Path

from bench_validate import model_file
from results import RESULTS, write_section

SECTION = "## Estimates against measurements"
SUBSECTION = "### Memory term by term"
MODELS = ("gpt:small", "resnet50:small", "mlp:small", "export:gpt2")
MIB = 2**20


def terms(args, plan, cluster: str) -> tuple[float, float, float]:
    """(B, A, G) of ``plan``: the estimate priced with parameter bytes as the model has
    them, with none, and with the gradient alone."""
    from tensoropt.cli.cmd_compile import estimate_of
    from tensoropt.cli.common import build_step
    from tensoropt.cost import model

    def memory(param_bytes) -> float:
        kept = model.param_bytes
        model.param_bytes = param_bytes
        try:
            step = build_step(args, load_weights=False)
            return estimate_of(step, plan, None, cluster).memory_bytes
        finally:
            model.param_bytes = kept

    full = memory(model.param_bytes)
    bare = memory(lambda *a, **k: 0.0)
    grads = memory(lambda elements, *a, **k: elements * a[2]) - bare  # a[2]: itemsize
    return full - bare - grads, bare, grads


def measure(model: str, cluster: str, tmp: Path, opts) -> list[dict]:
    from tensoropt.calibrate.validate import select_points
    from tensoropt.cli import build_parser
    from tensoropt.cli.cmd_validate import _explore
    from tensoropt.cli.common import build_step
    from tensoropt.passes.compile import compile_step
    from tensoropt.runtime.run import run_steps
    from tensoropt.search.driver import device_frontier, plan_of_point

    path = model_file(model, tmp)
    argv = ["validate", str(path), "--devices", "1,2", "--cluster", cluster,
            "--optimizer", opts.optimizer, "--axes", "split"]  # fmt: skip
    args = build_parser().parse_args(argv)
    _, _, exp = _explore(args, [1, 2])
    rows = []
    for d in (1, 2):
        frontier = device_frontier(exp, d)
        for k in select_points(len(frontier), opts.points):
            search, point = frontier[k]
            plan = plan_of_point(search, point, f"point {k} at {d} devices")
            out = tmp / f"{path.stem}-{d}-{k}"
            compile_step(build_step(args), plan, None, str(out))
            run = run_steps(str(out), opts.steps, backend="mpi", threads=1, profile=True)
            b, a, g = terms(args, plan, cluster)
            measured = max(r.memory_bytes for r in run.profile.ranks)
            rows.append(dict(model=model, devices=d, point=k, est=point.memory_bytes,
                             b=b, a=a, g=g, measured=measured))  # fmt: skip
            print(f"{model} {d} devices, point {k}: measured {measured / MIB:.1f} MiB", flush=True)
    return rows


def table(rows: list[dict]) -> list[str]:
    def err(est: float, meas: float) -> float:
        return (est - meas) / meas

    out = [
        "| model | dev | pt | B MiB | A MiB | G MiB | est MiB | meas MiB | X - B | est err "
        "| max(A, G) err |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        b, a, g, m = r["b"], r["a"], r["g"], r["measured"]
        out.append(
            f"| {r['model']} | {r['devices']} | {r['point']} | {b / MIB:.2f} | {a / MIB:.2f} "
            f"| {g / MIB:.2f} | {r['est'] / MIB:.2f} | {m / MIB:.2f} | {(m - b) / MIB:.2f} "
            f"| {err(r['est'], m):+.1%} | {err(b + max(a, g), m):+.1%} |"
        )
    est = statistics.median(abs(err(r["est"], r["measured"])) for r in rows)
    alt = statistics.median(abs(err(r["b"] + max(r["a"], r["g"]), r["measured"])) for r in rows)
    return [
        f"Median |error| over {len(rows)} plans: the estimate (B + A + G) {est:.1%}, "
        f"B + max(A, G) {alt:.1%}.",
        "",
        *out,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", required=True, help="a profile (tensoropt calibrate)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"))
    parser.add_argument("--points", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--write", action="store_true", help=f"replace '{SUBSECTION[4:]}' in {RESULTS.name}"
    )
    opts = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-memory-terms-") as tmp:
        for model in opts.models.split(","):
            rows += measure(model, opts.cluster, Path(tmp), opts)
    head = (
        f"`python benchmarks/bench_memory_terms.py --cluster CLUSTER.json --models "
        f"{opts.models} --optimizer {opts.optimizer} --points {opts.points}` -- "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}; measured: the "
        f"largest rank's growth of anonymous memory (run --profile, mpi backend)."
    )
    text = "\n".join([head, "", *table(rows), ""])
    print(text)
    if opts.write:
        write_section(SECTION, f"{SUBSECTION}\n\n{text}", SUBSECTION)


if __name__ == "__main__":
    main()
