"""``tensoropt run``: run a compiled output directory (per-device graphs) for K steps."""

from __future__ import annotations

import argparse
import math
import os
import sys

from tensoropt.cli.json_output import add_json_flag
from tensoropt.errors import ExitCode, TensorOptError

EPILOG = """\
backends:
  local  every rank in this process, in lockstep (deterministic; tests, --verify)
  mpi    one process per rank via the mpiexec next to this Python (MPICH wheel);
         --hostfile spreads the ranks over hosts (MPICH hydra -f format). Ranks start
         with glibc malloc tuned for steps: large blocks from the heap and kept there
         (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_) and transparent huge pages
         (GLIBC_TUNABLES=glibc.malloc.hugetlb=1; 2-8% faster steps here). Your own
         MALLOC_* values win; GLIBC_TUNABLES=glibc.malloc.hugetlb=0 turns the pages off

data: without --data the global batches are synthetic and seeded (the same ones
`tensoropt train` uses); --data FILE.npz holds arrays keyed by the model's input
names plus 'labels', each either the global shape or [steps, ...global shape].
Integer ids and labels must lie in [0, N) of the table or classes they index (the
bound synthetic data uses; a loss's ignore_index is allowed): checked before step 0.

--checkpoint DIR: each rank writes DIR/rank_<r>.step_<s>.tensors (its parameter and
optimizer-state shards as raw tensors after a JSON header), atomically; the ranks meet
after writing, then each drops its shards older than the newest two steps, so the kept
ones are steps every rank completed. --resume continues from the newest step every
rank has. A DIR holding another output's shards is refused; one holding this output's
needs --resume; --resume over shards that make no step every rank saved is refused
(nothing deleted); --resume of a missing or empty DIR starts at step 0.

--verify also runs annotated.onnx (the unpartitioned step) on the same batches and
prints, per step, the relative error  max|a-b| / max(max|b|, floor)  of the loss
and of the worst parameter (a = distributed, b = reference; floor = 1e-12 for the
loss, 1e-3 x the largest parameter magnitude for parameters), then a verdict.
Exit codes: 0 ok, 3 verification failed, 1 a worker died (or an internal error),
2 bad input.

--profile: per rank, medians over the steps after --profile-warmup of: the step's
wall time (segments + collectives + glue; batch generation excluded), compute (sum
of the segments' session.run times), communication (sum of the collectives' times)
and memory: the growth of the process's anonymous resident memory over the start
of the step loop (training state, activations in onnxruntime's arenas, buffers),
sampled after every segment and collective. With --backend local every rank lives
in one process and reports the process's memory. spread: how much the rank's step
times vary, (third quartile - first quartile) / median; above 0.1 the medians are
unsteady (other work on the machine, too few steps).

examples:
  tensoropt run out/ --steps 3 --verify
  tensoropt run out/ --steps 100 --backend mpi --checkpoint ckpt/
  tensoropt run out/ --steps 200 --backend mpi --checkpoint ckpt/ --resume
"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "run",
        help="run compiled per-device graphs (local or MPI) and print the loss per step",
        description="Run the per-device training-step graphs of OUTDIR (from `tensoropt "
        "compile`) for --steps steps, executing the collectives between them.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("outdir", metavar="OUTDIR")
    p.add_argument("--steps", type=int, default=10, help="global steps to run (default 10)")
    p.add_argument("--backend", choices=["local", "mpi"], default="local")
    p.add_argument("--verify", action="store_true", help="compare with the unpartitioned step")
    p.add_argument(
        "--tolerance",
        type=float,
        default=1e-4,
        help="largest relative error --verify accepts (default 1e-4)",
    )
    p.add_argument("--data", metavar="FILE.npz", help="training data (default: synthetic)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data")
    p.add_argument("--checkpoint", metavar="DIR", help="write per-rank checkpoint shards here")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        metavar="K",
        help="save every K steps and after the last (default 1; needs --checkpoint)",
    )
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint DIR")
    p.add_argument("--save-params", metavar="OUT.npz", help="save the full trained parameters")
    p.add_argument("--hostfile", metavar="FILE", help="MPI hostfile (--backend mpi)")
    p.add_argument("--threads", type=int, help="onnxruntime intra-op threads per rank")
    p.add_argument(
        "--arena",
        choices=["shared", "shared-pow2", "per-session", "none"],  # runtime.arena.ArenaMode
        default="shared",
        help="where a rank's tensors live: one pool per rank growing as requested (default, "
        "like a device), the same growing by doubling, one pool per graph segment "
        "(onnxruntime's default), or no pool",
    )
    p.add_argument(
        "--stall-timeout", type=float, metavar="S", help="stop an MPI job with no step for S s"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="per rank: median step, compute and communication time and peak memory",
    )
    p.add_argument(
        "--profile-warmup", type=int, default=2, metavar="W", help="steps left out (default 2)"
    )
    add_json_flag(p, "tensoropt.run/1")
    p.set_defaults(func=run)


class _Table:
    """Per-step rows on stdout (through tqdm so the bar on stderr stays intact)."""

    def __init__(self, steps: int, verify: bool, quiet: bool) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=steps, desc="run", file=sys.stderr, disable=None, leave=False)
        self._verify = verify
        self._quiet = quiet
        self._started = False

    def header(self) -> str:
        cols = f"{'step':>6}  {'loss':>12}"
        return cols + (f"  {'rel.err loss':>12}  {'rel.err params':>14}" if self._verify else "")

    def on_step(self, step: int, loss: float, vstep) -> None:
        if not self._started:
            self._started = True
            self._bar.n = step
            if not self._quiet:
                self._bar.write(self.header(), file=sys.stdout)
        self._bar.update(1)
        if self._quiet:
            return
        row = f"{step:>6}  {loss:>12.6f}"
        if vstep is not None:
            row += f"  {vstep.rel_error_loss:>12.3e}  {vstep.max_rel_error_params:>14.3e}"
        self._bar.write(row, file=sys.stdout)

    def close(self) -> None:
        self._bar.close()


def profile_table(profile) -> str:
    """One row per rank: medians of step, compute, communication, other; memory."""
    lines = [
        f"profile: medians over {profile.ranks[0].steps} steps after {profile.warmup} warm-up",
        f"{'rank':>6}  {'step ms':>9}  {'compute ms':>10}  {'comm ms':>8}  {'other ms':>8}  "
        f"{'spread':>6}  {'memory MiB':>10}",
    ]
    for r in profile.ranks:
        other = max(r.step_s - r.compute_s - r.comm_s, 0.0)
        lines.append(
            f"{r.rank:>6}  {r.step_s * 1e3:>9.3f}  {r.compute_s * 1e3:>10.3f}  "
            f"{r.comm_s * 1e3:>8.3f}  {other * 1e3:>8.3f}  {r.step_spread:>6.2f}  "
            f"{r.memory_bytes / 2**20:>10.2f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from tensoropt.cli.common import check_output_file
    from tensoropt.cli.json_output import document, emit, finite_or_null
    from tensoropt.runtime.run import run_steps

    if not math.isfinite(args.tolerance) or args.tolerance <= 0:
        raise TensorOptError(f"--tolerance must be a positive finite number, got {args.tolerance}")
    if args.checkpoint_every is not None and args.checkpoint is None:
        raise TensorOptError(
            f"--checkpoint-every {args.checkpoint_every} needs --checkpoint DIR (where the "
            "shards go)"
        )
    if args.threads is not None and args.threads < 1:
        raise TensorOptError(f"--threads {args.threads}: give at least 1")
    if args.stall_timeout is not None and args.stall_timeout <= 0:
        raise TensorOptError(f"--stall-timeout {args.stall_timeout}: give a positive number")
    if args.profile_warmup < 0:
        raise TensorOptError(f"--profile-warmup {args.profile_warmup}: give 0 or more steps")
    ckpt = args.checkpoint
    if ckpt is not None and os.path.exists(ckpt) and not os.path.isdir(ckpt):
        raise TensorOptError(
            f"--checkpoint {ckpt}: is a file; give a directory (it is created when missing)"
        )
    check_output_file(args.save_params, "--save-params")
    table = _Table(args.steps, args.verify, quiet=args.json)
    try:
        result = run_steps(
            args.outdir,
            args.steps,
            backend=args.backend,
            data=args.data,
            checkpoint=args.checkpoint,
            resume=args.resume,
            hostfile=args.hostfile,
            verify=args.verify,
            save_params=args.save_params,
            seed=args.seed,
            checkpoint_every=1 if args.checkpoint_every is None else args.checkpoint_every,
            tolerance=args.tolerance,
            threads=args.threads,
            stall_timeout=args.stall_timeout,
            on_step=table.on_step,
            profile=args.profile,
            profile_warmup=args.profile_warmup,
            arena=args.arena,
        )
    finally:
        table.close()
    if result.warning is not None:
        print(result.warning, file=sys.stderr)
    report = result.verify
    if args.json:
        emit(
            args,
            document(
                "tensoropt.run/1",
                {
                    "outdir": args.outdir,
                    "backend": args.backend,
                    "world_size": result.world_size,
                    "steps": args.steps,
                    "start_step": result.start_step,
                    "losses": finite_or_null(result.losses),  # null where not finite
                    "seconds": result.seconds,
                    "saved_params": args.save_params,
                    "verify": None if report is None else report.to_json(),
                    "profile": None if result.profile is None else result.profile.to_json(),
                },
            ),
        )
    elif result.profile is not None:
        print(profile_table(result.profile))
    elif report is not None:
        verdict = "ok" if report.ok else "FAILED"
        print(
            f"verify: {verdict}: max relative error loss {report.max_rel_error_loss:.3e}, "
            f"params {report.max_rel_error_params:.3e} (tolerance {report.tolerance:g})"
        )
        noise = report.noise_params
        if noise:
            listed = ", ".join(f"{name} {e:.1e}" for name, e in sorted(noise.items()))
            print(
                f"verify: {len(noise)} parameter(s) over the tolerance are within the "
                "reference's own rounding sensitivity (the step with its samples "
                f"reordered moves them as much; see docs/design/runtime.md): {listed}"
            )
    if report is not None and not report.ok:
        print(
            "tensoropt run: error: the distributed run differs from the unpartitioned step "
            f"by more than {report.tolerance:g}",
            file=sys.stderr,
        )
        return ExitCode.VERIFY_FAILED
    return 0
