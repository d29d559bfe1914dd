"""``run_steps``: run a compiled output directory for some steps (the runtime's API).

Everything that can be checked before any process starts is checked here, in the
calling process: the files' sha256 (:func:`~tensoropt.runtime.manifest.load_outdir`),
the ``--data`` file, and that every rank issues the same collectives in the same
order. Then the ``local`` backend runs in this process and the ``mpi`` backend
is launched by :mod:`tensoropt.runtime.launcher`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from tensoropt.errors import TensorOptError
from tensoropt.runtime.arena import ArenaMode
from tensoropt.runtime.checkpoint import save_npz
from tensoropt.runtime.data import (
    check_indices,
    index_exceptions,
    load_npz,
    not_finite_warning,
    specs_from_manifest,
)
from tensoropt.runtime.driver import Backend, OnStep, RunOptions, RunResult, drive
from tensoropt.runtime.engine import LocalEngine, load_device, split_all, split_rank
from tensoropt.runtime.malloc import tune_process
from tensoropt.runtime.manifest import Manifest, load_outdir
from tensoropt.runtime.program import SessionConfig, check_collective_order
from tensoropt.runtime.split import collective_order
from tensoropt.runtime.verify import DEFAULT_TOLERANCE


def run_steps(
    outdir: str | os.PathLike,
    steps: int,
    backend: str | Backend = Backend.LOCAL,
    data: str | os.PathLike | None = None,
    checkpoint: str | os.PathLike | None = None,
    resume: bool = False,
    hostfile: str | os.PathLike | None = None,
    verify: bool = False,
    save_params: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    checkpoint_every: int = 1,
    tolerance: float = DEFAULT_TOLERANCE,
    threads: int | None = None,
    stall_timeout: float | None = None,
    on_step: OnStep | None = None,
    profile: bool = False,
    profile_warmup: int = 2,
    arena: ArenaMode | str = ArenaMode.SHARED,
) -> RunResult:
    """Run global steps 0..steps-1 (or continue them with ``resume``) of OUTDIR.

    Returns the loss of every step (the replicated ``loss`` output; after a resume
    the earlier losses come from the checkpoint) and the full parameters and
    optimizer state, reassembled from the rank shards under their original names.
    ``on_step(step, loss, verify_step_or_None)`` is called after every step.
    ``profile`` times every rank's steps after ``profile_warmup`` steps
    (``RunResult.profile``; see :mod:`tensoropt.runtime.profiling`). ``arena`` says
    where onnxruntime puts tensors (:class:`~tensoropt.runtime.arena.ArenaMode`; the
    default, one shared arena per process, is what a device's single memory pool does).
    """
    backend = _backend(backend)
    arena = _arena(arena)
    if steps < 1:
        raise TensorOptError(f"--steps must be at least 1, got {steps}")
    if checkpoint_every < 1:
        raise TensorOptError(f"--checkpoint-every must be at least 1, got {checkpoint_every}")
    if profile and not 0 <= profile_warmup < steps:
        raise TensorOptError(
            f"--profile: {steps} steps leave none after {profile_warmup} warm-up steps; "
            f"run at least {profile_warmup + 1} steps"
        )
    if resume and checkpoint is None:
        raise TensorOptError("--resume needs --checkpoint DIR (where the shards are)")
    if hostfile is not None and backend is not Backend.MPI:
        raise TensorOptError("--hostfile only applies to --backend mpi")
    if hostfile is not None:
        _check_hostfile(Path(hostfile))
    if not math.isfinite(tolerance) or tolerance <= 0:
        raise TensorOptError(f"--tolerance must be a positive finite number, got {tolerance}")
    manifest = load_outdir(outdir)
    if checkpoint is not None:
        _check_checkpoint(checkpoint, manifest, steps, resume)
    if verify and not (manifest.outdir / "annotated.onnx").is_file():
        raise TensorOptError(
            f"{manifest.outdir}: --verify needs annotated.onnx; recompile the model"
        )
    if data is not None:
        _check_data(data, manifest, steps)
    opts = RunOptions(
        steps=steps,
        seed=seed,
        data=None if data is None else str(Path(data).resolve()),
        checkpoint=None if checkpoint is None else str(Path(checkpoint).resolve()),
        checkpoint_every=checkpoint_every,
        resume=resume,
        verify=verify,
        tolerance=tolerance,
        threads=threads,
        profile=profile,
        profile_warmup=profile_warmup,
        arena=arena,
    )
    if backend is Backend.LOCAL:
        result = _run_local(manifest, opts, on_step)
    else:
        result = _run_mpi(manifest, opts, hostfile, on_step, stall_timeout)
    if save_params is not None:
        save_npz(save_params, result.params)
    specs = specs_from_manifest(manifest)
    warning = not_finite_warning("run", result.losses, specs, synthetic=data is None)
    return dataclasses.replace(result, warning=warning)


def _check_checkpoint(checkpoint, manifest: Manifest, steps: int, resume: bool) -> None:
    """Refuse a checkpoint directory of another output, one of this output without
    --resume, nothing complete to resume from, or a resume that would run no step (the
    checkpoint is already at --steps); before any rank starts or any shard is dropped."""
    from tensoropt.runtime.checkpoint import check_directory

    done = check_directory(checkpoint, manifest.world_size, manifest.sha256, resume)
    if done is not None and done >= steps:
        raise TensorOptError(
            f"--resume: {checkpoint} already holds step {done}, and --steps {steps} asks for "
            f"no more; give --steps above {done} to continue training"
        )


def _check_data(data, manifest: Manifest, steps: int) -> None:
    """Shapes and dtypes of the --data file, and integer inputs that index a table within
    its bound (an out-of-range id would fail inside onnxruntime on some rank)."""
    specs = specs_from_manifest(manifest)
    source = load_npz(data, specs, steps)
    bounded = [s.name for s in specs if s.high is not None]
    if not bounded:
        return
    # rank 0 holds the data inputs; the loss (and its labels) is on ``loss_rank``
    graphs = [load_device(manifest, r) for r in sorted({0, manifest.loss_rank})]
    exceptions = index_exceptions(graphs, bounded)
    labels = manifest.step.get("labels")
    check_indices(source, specs, steps, exceptions, labels)


def _check_hostfile(path: Path) -> None:
    """Refuse a hostfile mpiexec could not read (it would fail as a dead rank)."""
    if not path.exists():
        raise TensorOptError(f"--hostfile {path}: no such file; give an MPI hostfile")
    if path.is_dir():
        raise TensorOptError(f"--hostfile {path}: is a directory; give an MPI hostfile")
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise TensorOptError(
            f"--hostfile {path}: cannot be read ({exc.strerror}); give a readable hostfile"
        ) from None


def _choice(enum_cls, value, what: str):
    """``value`` as a member of ``enum_cls``, or one line naming the choices."""
    try:
        return enum_cls(value)
    except ValueError:
        choices = ", ".join(m.value for m in enum_cls)
        raise TensorOptError(f"unknown {what} {value!r}; choose one of {choices}") from None


def _backend(value: str | Backend) -> Backend:
    return _choice(Backend, value, "backend")


def _arena(value: ArenaMode | str) -> ArenaMode:
    return _choice(ArenaMode, value, "arena mode")


def _run_local(manifest: Manifest, opts: RunOptions, on_step: OnStep | None) -> RunResult:
    tune_process()  # the MPI ranks get the same malloc settings through their environment
    models = {r: load_device(manifest, r) for r in range(manifest.world_size)}
    config = SessionConfig(intra_op_threads=opts.threads or 0, arena=opts.arena)
    if manifest.pipeline is not None:
        from tensoropt.runtime.pipeline import PipelineLocalEngine

        staged = {r: split_rank(manifest, m, r) for r, m in models.items()}
        engine = PipelineLocalEngine(staged, manifest.loss_name, config)  # type: ignore[arg-type]
    else:
        engine = LocalEngine(split_all(manifest, models), config)
    result = drive(engine, manifest, models, opts, on_step)
    assert result is not None  # the local engine is always the root
    return result


def _run_mpi(
    manifest: Manifest,
    opts: RunOptions,
    hostfile: str | os.PathLike | None,
    on_step: OnStep | None,
    stall_timeout: float | None,
) -> RunResult:
    from tensoropt.runtime.launcher import launch

    if manifest.pipeline is None:  # pipelined devices are checked per stage by the workers
        orders = {
            r: collective_order(load_device(manifest, r), r, manifest.world_size)
            for r in range(manifest.world_size)
        }
        check_collective_order(orders)
    return launch(
        manifest.outdir.resolve(),
        manifest.world_size,
        opts,
        None if hostfile is None else str(hostfile),
        on_step,
        stall_timeout,
    )
