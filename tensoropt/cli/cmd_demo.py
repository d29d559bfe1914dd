"""``tensoropt demo``: the main job, start to finish, on the zoo's tiny GPT."""

from __future__ import annotations

import argparse
import os
import sys
import time

EPILOG = """\
steps:
  1. writes the zoo model gpt (tiny preset) to DIR/gpt.onnx
  2. searches the frontier for 1 to 8 devices and prints it (plot: DIR/frontier.png)
  3. compiles the fastest 2-device plan to DIR/compiled/
  4. runs it as 2 real MPI processes with --verify against the single-device step
and says where everything was written. Every step is an ordinary command you can
rerun by hand (they are printed as it goes).
"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="search, compile and run the tiny GPT end to end (about half a minute)",
        description="The main job on the zoo's gpt tiny preset.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--dir", default="tensoropt-demo", help="where to write (default ./tensoropt-demo)"
    )
    p.add_argument("--backend", choices=["mpi", "local"], default="mpi")
    p.add_argument("--cluster", default="h100")
    p.set_defaults(func=run)


def _say(text: str) -> None:
    print(f"\n== {text}", flush=True)


def run(args: argparse.Namespace) -> int:
    from tensoropt.cli import main

    start = time.perf_counter()
    os.makedirs(args.dir, exist_ok=True)
    model = os.path.join(args.dir, "gpt.onnx")
    plot = os.path.join(args.dir, "frontier.png")
    search_json = os.path.join(args.dir, "search.json")
    outdir = os.path.join(args.dir, "compiled")
    steps = [
        ("write the model", ["model", "gpt", "--preset", "tiny", "-o", model]),
        (
            "search devices 1 to 8",
            [
                "search",
                model,
                "--devices",
                "1-8",
                "--cluster",
                args.cluster,
                "--plot",
                plot,
                "--json",
                search_json,
            ],
        ),
        (
            "compile the fastest 2-device plan",
            [
                "compile",
                model,
                "--devices",
                "2",
                "--pick",
                "fastest",
                "--cluster",
                args.cluster,
                "-o",
                outdir,
            ],
        ),
        (
            f"run 3 steps as 2 processes ({args.backend}) and verify against one device",
            ["run", outdir, "--steps", "3", "--backend", args.backend, "--verify"],
        ),
    ]
    for title, argv in steps:
        _say(f"{title}: tensoropt {' '.join(argv)}")
        code = main(argv)
        if code != 0:
            print(f"tensoropt demo: step failed: tensoropt {' '.join(argv)}", file=sys.stderr)
            return code
    elapsed = time.perf_counter() - start
    _say(f"done in {elapsed:.1f} s; written:")
    for path, what in (
        (model, "the model (ONNX)"),
        (plot, "the frontier plot"),
        (search_json, "every frontier point with its plan"),
        (outdir, "one training-step graph per device, plan.json, manifest.json"),
    ):
        print(f"  {path:<40} {what}")
    print(f"  inspect the compiled graphs: tensoropt inspect {outdir}")
    return 0
