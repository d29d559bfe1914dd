"""The training loop around an engine, and the public entry point :func:`run_steps`.

:func:`drive` runs in every process (once for ``local``, once per MPI rank):
global batch -> per-rank slices -> engine step -> carry ``__new`` outputs into the
next step's inputs -> (verify, checkpoint, report). It is written once for both
engines; only rank 0 (the root) builds the :class:`RunResult`.
"""

from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tensoropt.errors import TensorOptError
from tensoropt.runtime import checkpoint as ckpt
from tensoropt.runtime.arena import ArenaMode
from tensoropt.runtime.data import batch_source, specs_from_manifest
from tensoropt.runtime.engine import Engine, initial_state
from tensoropt.runtime.manifest import InputKind, Manifest, assemble, block_of, shard
from tensoropt.runtime.profiling import ProfileReport, StepClock, StepRecord
from tensoropt.runtime.verify import DEFAULT_TOLERANCE, Reference, VerifyReport, VerifyStep

log = logging.getLogger(__name__)

State = dict[str, np.ndarray]
OnStep = Callable[[int, float, "VerifyStep | None"], None]


class Backend(enum.Enum):
    LOCAL = "local"
    MPI = "mpi"


@dataclass(frozen=True, slots=True)
class RunOptions:
    """Everything a run needs besides the output directory (travels to MPI workers)."""

    steps: int
    seed: int = 0
    data: str | None = None
    checkpoint: str | None = None
    checkpoint_every: int = 1
    resume: bool = False
    verify: bool = False
    tolerance: float = DEFAULT_TOLERANCE
    threads: int | None = None  # onnxruntime intra-op threads per rank (None = default)
    profile: bool = False  # time segments and collectives, sample memory (run --profile)
    profile_warmup: int = 2  # steps left out of the profile's medians
    fault: tuple[int, int, str] | None = None  # (rank, step, "exit"|"hang"): tests only
    arena: ArenaMode = ArenaMode.SHARED  # onnxruntime CPU memory pools (runtime.arena)

    def to_json(self) -> dict:
        d = {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]
        d["fault"] = list(self.fault) if self.fault else None
        d["arena"] = self.arena.value
        return d

    @staticmethod
    def from_json(d: Mapping) -> RunOptions:
        fault = d.get("fault")
        arena = ArenaMode(d.get("arena", ArenaMode.SHARED.value))
        return RunOptions(**{**d, "fault": tuple(fault) if fault else None, "arena": arena})


@dataclass(frozen=True, slots=True)
class RunResult:
    """What a run produced: the loss per global step and the gathered full tensors."""

    losses: list[float]
    params: dict[str, np.ndarray]
    states: dict[str, np.ndarray] = field(default_factory=dict)
    verify: VerifyReport | None = None
    start_step: int = 0  # first step this run executed (> 0 after --resume)
    world_size: int = 1
    backend: str = "local"
    seconds: float = 0.0
    profile: ProfileReport | None = None
    # one line for the user when a loss is not finite (``data.not_finite_warning``)
    warning: str | None = None


@dataclass(slots=True)
class _Loop:
    """Mutable loop state of one process."""

    state: dict[int, State]
    losses: list[float]
    start: int
    reference: Reference | None = None
    verify_steps: list[VerifyStep] = field(default_factory=list)
    saved: list[int] = field(default_factory=list)  # steps every rank saved, oldest first


def drive(
    engine: Engine,
    manifest: Manifest,
    models: Mapping,
    opts: RunOptions,
    on_step: OnStep | None = None,
) -> RunResult | None:
    """Run steps ``[start, opts.steps)`` on ``engine``; the root returns the result."""
    t0 = time.perf_counter()
    source = batch_source(specs_from_manifest(manifest), opts.data, opts.seed, opts.steps)
    clocks = engine.enable_profiling() if opts.profile else {}
    for clock in clocks.values():
        clock.start_loop()  # before the training state exists: memory counts from here
    records: dict[int, list[StepRecord]] = {r: [] for r in clocks}
    loop = _start(engine, manifest, models, opts)
    for k in range(loop.start, opts.steps):
        if opts.fault and opts.fault[1] == k and opts.fault[0] in engine.ranks:
            _inject(opts.fault[2])
        batch = source(k)
        feeds = {r: _feeds(manifest, batch, loop.state[r], r) for r in engine.ranks}
        for clock in clocks.values():
            clock.start_step()
        t_step = time.perf_counter()
        outs = engine.step(feeds)
        t_step = time.perf_counter() - t_step
        for r, clock in clocks.items():
            records[r].append(clock.record(k, t_step))
        loop.state = {r: _carry(manifest, outs[r], r) for r in engine.ranks}
        loss = float(outs[engine.ranks[0]][manifest.loss_name])  # every rank has the loss
        loop.losses.append(loss)
        vstep = _verify_step(engine, manifest, loop, k, batch, loss) if opts.verify else None
        if opts.checkpoint and ((k + 1) % opts.checkpoint_every == 0 or k + 1 == opts.steps):
            _save(engine, manifest, opts, loop, k + 1)
        if on_step is not None and engine.is_root:
            on_step(k, loss, vstep)
    params, states = _gather_global(engine, manifest, loop.state)
    profile = _gather_profile(engine, records, clocks, opts.profile_warmup)
    if not engine.is_root:
        return None
    report = VerifyReport(tuple(loop.verify_steps), opts.tolerance) if opts.verify else None
    return RunResult(
        losses=loop.losses,
        params=params,
        states=states,
        verify=report,
        start_step=loop.start,
        world_size=manifest.world_size,
        seconds=time.perf_counter() - t0,
        profile=profile,
    )


def _gather_profile(
    engine: Engine, records: dict[int, list[StepRecord]], clocks: dict[int, StepClock], warmup
) -> ProfileReport | None:
    if not clocks:
        return None
    gathered = engine.gather(records)  # rank -> that rank's step records (root only)
    if gathered is None:
        return None
    return ProfileReport.from_records(gathered, warmup)


def _inject(mode: str) -> None:
    """Fault injection for the launcher tests: die without any cleanup, or hang."""
    if mode == "hang":
        time.sleep(3600)
    os._exit(17)


def _state_names(manifest: Manifest, rank: int) -> list[str]:
    """The parameters and optimizer states ``rank`` holds."""
    kinds = (InputKind.PARAM, InputKind.STATE)
    return [i.name for i in manifest.inputs_of(*kinds) if manifest.holds(rank, i.name)]


def _start(engine: Engine, manifest: Manifest, models: Mapping, opts: RunOptions) -> _Loop:
    loop = _Loop(
        {r: initial_state(manifest, models[r], _state_names(manifest, r), r) for r in engine.ranks},
        [],
        0,
    )
    if opts.resume:
        _resume(engine, manifest, opts, loop)
    if opts.verify:
        # The reference starts from the global values assembled from the rank shards;
        # an annotated.onnx that stores its own initial values (and a run from step 0)
        # starts from those instead, which also checks how compile sliced them.
        params, states = _gather_global(engine, manifest, loop.state)
        if engine.is_root:
            loop.reference = Reference.open(manifest.outdir, opts.threads, opts.arena)
            loop.reference.tolerance = opts.tolerance
            if loop.start > 0 or not loop.reference.state:
                # copies: a step-phase update writes over the ranks' own state arrays
                # (runtime.inplace), which gathering may hand back as they are
                loop.reference.state = {k: v.copy() for k, v in {**params, **states}.items()}
    return loop


def _resume(engine: Engine, manifest: Manifest, opts: RunOptions, loop: _Loop) -> None:
    if not opts.checkpoint:
        raise TensorOptError("--resume needs --checkpoint DIR (where the shards are)")
    directory = Path(opts.checkpoint)
    step = ckpt.latest_common_step(directory, manifest.world_size)
    if step is None:
        if ckpt.has_shards(directory):  # run_steps refused this before it started
            raise TensorOptError(
                f"--resume: {directory} holds no step every rank saved; nothing to resume from"
            )
        log.warning("%s: no checkpoint yet; starting from step 0", directory)
        return
    for r in engine.ranks:
        state, meta = ckpt.load_shard(directory, r, step)
        ckpt.check_meta(meta, opts.seed, manifest.world_size, manifest.sha256, directory)
        missing = set(_state_names(manifest, r)) - set(state)
        if missing:
            raise TensorOptError(f"{directory}: rank {r} shard lacks {sorted(missing)}")
        loop.state[r] = state
        loop.losses = list(meta.losses)
    loop.start = step
    loop.saved = [step]
    log.info("resuming from %s at step %d", directory, step)


def _feeds(manifest: Manifest, batch: Mapping[str, np.ndarray], state: State, rank: int) -> dict:
    feeds = dict(state)
    for name, array in batch.items():
        if manifest.holds(rank, name):
            feeds[name] = shard(array, manifest.inputs[name], manifest, rank)
    return feeds


def _carry(manifest: Manifest, outputs: Mapping[str, np.ndarray], rank: int) -> State:
    carry = manifest.carry_of(rank)
    missing = [o for o in carry if o not in outputs]
    if missing:
        raise TensorOptError(
            f"device graphs lack the carried outputs {missing}; recompile the model"
        )
    return {carry[o]: outputs[o] for o in carry}


def _gather_global(
    engine: Engine,
    manifest: Manifest,
    state: Mapping[int, State],
    kinds: tuple[InputKind, ...] = (InputKind.PARAM, InputKind.STATE),
):
    """Full parameters and states from the rank shards (root only; else empty dicts).

    One tensor at a time, and only from the lowest rank holding each block (a
    replicated tensor comes from rank 0 alone): the root never holds more than the
    result plus one tensor's pieces, which matters when the state is gigabytes."""
    params: dict[str, np.ndarray] = {}
    states: dict[str, np.ndarray] = {}
    for info in manifest.inputs_of(*kinds):
        owners = _owners(info, manifest)
        pieces = engine.gather(
            {r: state[r][info.name] if r in owners else None for r in engine.ranks}
        )
        if pieces is None:
            continue
        held = {r: v for r, v in pieces.items() if v is not None}
        only = next(iter(held.values()))
        if len(held) == 1 and only.shape == info.global_shape:
            full = only  # replicated: the root's own array (values are never changed in place)
        else:
            full = assemble(held, info, manifest)
        (params if info.kind is InputKind.PARAM else states)[info.name] = full
    return params, states


def _owners(info, manifest: Manifest) -> set[int]:
    """Ranks whose block of ``info`` no lower rank holds (blocks are equal or disjoint)."""
    seen: set[tuple] = set()
    owners: set[int] = set()
    for r in manifest.ranks:
        if not manifest.holds(r.rank, info.name):
            continue
        block = block_of(info.global_shape, info.placements, manifest.mesh_shape, r.coords)
        key = tuple((b.start, b.stop) for b in block)
        if key not in seen:
            seen.add(key)
            owners.add(r.rank)
    return owners


def _verify_step(engine, manifest, loop: _Loop, k: int, batch, loss: float) -> VerifyStep | None:
    params, _ = _gather_global(engine, manifest, loop.state, (InputKind.PARAM,))
    if loop.reference is None:
        return None
    vstep = loop.reference.step_and_compare(k, batch, loss, params)
    loop.verify_steps.append(vstep)
    return vstep


def _save(engine: Engine, manifest: Manifest, opts: RunOptions, loop: _Loop, step: int) -> None:
    meta = ckpt.CheckpointMeta(
        step, tuple(loop.losses), opts.seed, manifest.world_size, manifest.sha256
    )
    for r in engine.ranks:
        ckpt.save_shard(opts.checkpoint, r, loop.state[r], meta)
    # A coordinated point: no rank drops an older shard before every rank has written
    # this one, so the kept shards are steps every rank completed even where ranks run
    # apart between checkpoints (a plan without collectives never waits for the others).
    engine.barrier()
    loop.saved = [*loop.saved, step][-ckpt.KEEP :]
    for r in engine.ranks:
        ckpt.prune(opts.checkpoint, r, loop.saved)
