"""Engines: run one training step on the ranks this process holds.

* :class:`LocalEngine` holds every rank and runs them in lockstep: segment i on
  every rank, then collective i over its groups (``local`` backend).
* :class:`MpiEngine` holds one rank and runs its whole step with an
  :class:`~tensoropt.runtime.mpi_comm.MpiCommunicator` (``mpi`` backend).

The driver (:mod:`tensoropt.runtime.driver`) talks to both through the same
methods: ``ranks``, ``is_root``, ``step`` and ``gather``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import onnx

from tensoropt.errors import OutputDirError, TensorOptError
from tensoropt.runtime.comm import LocalWorld
from tensoropt.runtime.external import load_graph, read_initializer
from tensoropt.runtime.manifest import InputInfo, InputInit, Manifest, block_of
from tensoropt.runtime.micro import PhasedPlan, accumulate, micro_feeds, split_phases
from tensoropt.runtime.profiling import StepClock
from tensoropt.runtime.program import (
    RankProgram,
    SessionConfig,
    check_collective_order,
    check_lockstep,
    lockstep,
)
from tensoropt.runtime.split import SplitPlan, shared_weights, split_graph

Feeds = Mapping[str, np.ndarray]
RankPlan = SplitPlan | PhasedPlan  # a plain step, or a micro-batched one


class Engine(Protocol):
    @property
    def ranks(self) -> tuple[int, ...]: ...

    @property
    def is_root(self) -> bool: ...

    def step(self, feeds: Mapping[int, Feeds]) -> dict[int, dict[str, np.ndarray]]: ...

    def gather(self, per_rank: Mapping[int, Any]) -> dict[int, Any] | None: ...

    def enable_profiling(self) -> dict[int, StepClock]: ...

    def barrier(self) -> None:
        """Return once every rank of the world has called it (a checkpoint's save)."""
        ...


def load_device(manifest: Manifest, rank: int) -> onnx.ModelProto:
    """Rank ``rank``'s device graph without its weight bytes (they stay in its data file)."""
    return load_graph(manifest.device_path(rank))


def fed_names(manifest: Manifest) -> set[str]:
    """Inputs fed every step: everything the manifest describes."""
    return set(manifest.inputs)


def split_rank(manifest: Manifest, model: onnx.ModelProto, rank: int) -> RankPlan:
    """Split one rank's graph; its shared constants are read once from OUTDIR.

    A micro-batched step splits into its two phases (``runtime.micro``), a pipelined
    one also into its stage's forward and backward parts (``runtime.pipeline``)."""
    fed = fed_names(manifest)
    weights = shared_weights(model, fed, manifest.outdir)
    if manifest.pipeline is not None:
        from tensoropt.runtime.pipeline import split_staged

        return split_staged(manifest, model, rank, fed, weights)
    if manifest.micro is not None:
        dims = {i.name: i.micro_dim for i in manifest.inputs.values() if i.micro_dim is not None}
        carry = manifest.carry_of(rank)
        return split_phases(
            model, rank, manifest.world_size, fed, weights, manifest.micro, dims, carry
        )
    return split_graph(model, rank, manifest.world_size, fed, weights)


def split_all(manifest: Manifest, models: Mapping[int, onnx.ModelProto]) -> dict[int, RankPlan]:
    """Split every given rank's graph and run the cross-rank pre-check."""
    plans = {r: split_rank(manifest, m, r) for r, m in models.items()}
    check_collective_order({r: p.collectives for r, p in plans.items()})
    return plans


def initial_state(
    manifest: Manifest, model: onnx.ModelProto, names: Sequence[str], rank: int
) -> dict[str, np.ndarray]:
    """Initial local parameter/state values of ``rank``.

    An input marked ``"init": "zeros"`` starts as zeros of its local shard shape;
    any other is the device graph's initializer, read from the rank's data file."""
    inits = {t.name: t for t in model.graph.initializer if t.name in set(names)}
    state: dict[str, np.ndarray] = {}
    missing = []
    for name in names:
        info = manifest.inputs[name]
        if info.init is InputInit.ZEROS:
            state[name] = np.zeros(local_shape(info, manifest, rank), dtype=info.dtype)
        elif name in inits:
            value = read_initializer(inits[name], manifest.outdir)
            # writable: a step-phase update may write its new value over it (runtime.inplace)
            state[name] = value if value.flags.writeable else value.copy()
        else:
            missing.append(name)
    if missing:
        raise OutputDirError(
            f"device graph of rank {rank} has no initializer for {missing}; recompile the model"
        )
    return state


def local_shape(info: InputInfo, manifest: Manifest, rank: int) -> tuple[int, ...]:
    """The shape of ``rank``'s piece of an input (the slicing rule)."""
    coords = manifest.ranks[rank].coords
    block = block_of(info.global_shape, info.placements, manifest.mesh_shape, coords)
    return tuple(b.stop - b.start for b in block)


class LocalEngine:
    """Every rank in this process, run in lockstep; deterministic."""

    def __init__(self, plans: Mapping[int, RankPlan], config: SessionConfig | None = None):
        sessions = sum(p.num_segments for p in plans.values())
        config = (config or SessionConfig()).for_sessions(sessions)
        self._world = LocalWorld(len(plans))
        self._phased = _phased(plans)
        if self._phased is None:
            self._programs = {r: RankProgram(plans[r], config) for r in sorted(plans)}  # type: ignore[arg-type]
            check_lockstep(plans)  # type: ignore[arg-type]
        else:
            micro = {r: p.micro for r, p in self._phased.items()}  # type: ignore[union-attr]
            step = {r: p.step for r, p in self._phased.items()}  # type: ignore[union-attr]
            check_lockstep(micro)
            check_lockstep(step)
            self._micro = {r: RankProgram(micro[r], config) for r in sorted(plans)}
            self._programs = {r: RankProgram(step[r], config) for r in sorted(plans)}

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(self._programs)

    @property
    def is_root(self) -> bool:
        return True

    def step(self, feeds: Mapping[int, Feeds]) -> dict[int, dict[str, np.ndarray]]:
        if self._phased is None:
            return self._lockstep(self._programs, feeds)
        first = self._phased[min(self._phased)]
        cut, dims = first.cut, first.micro_dims
        totals: dict[int, dict[str, np.ndarray]] = {r: {} for r in self._programs}
        for m in range(cut.batches):
            parts = {r: micro_feeds(feeds[r], cut, dims, m) for r in self._programs}
            outs = self._lockstep(self._micro, parts)
            for r in self._programs:
                accumulate(totals[r], outs[r], cut)
            del parts, outs
        rest = {r: {n: v for n, v in feeds[r].items() if n not in dims} for r in feeds}
        return self._lockstep(self._programs, {r: {**rest[r], **totals[r]} for r in rest})

    def _lockstep(
        self, programs: Mapping[int, RankProgram], feeds: Mapping[int, Feeds]
    ) -> dict[int, dict[str, np.ndarray]]:
        return lockstep(self._world, programs, feeds, self._add_comm)

    def gather(self, per_rank: Mapping[int, Any]) -> dict[int, Any] | None:
        return dict(per_rank)

    def barrier(self) -> None:
        """Every rank is in this process and each call covers them all: nothing to wait for."""

    def enable_profiling(self) -> dict[int, StepClock]:
        """One clock per rank; a batched collective counts for every rank (lockstep)."""
        for r, p in self._programs.items():
            p.clock = StepClock()
            if self._phased is not None:
                self._micro[r].clock = p.clock
        return {r: p.clock for r, p in self._programs.items()}  # type: ignore[misc]

    def _add_comm(self, seconds: float) -> None:
        for p in self._programs.values():
            if p.clock is not None:
                p.clock.add_comm(seconds)


def _phased(plans: Mapping[int, RankPlan]) -> dict[int, PhasedPlan] | None:
    """The plans if every rank's step is micro-batched, None if none is."""
    phased = {r: p for r, p in plans.items() if isinstance(p, PhasedPlan)}
    if not phased:
        return None
    if len(phased) != len(plans):
        raise TensorOptError("some ranks' steps are micro-batched and some not; recompile")
    return phased


class MpiEngine:
    """This process's single MPI rank."""

    def __init__(self, plan: RankPlan, comm: Any = None, config: SessionConfig | None = None):
        from tensoropt.runtime.mpi_comm import MpiCommunicator

        self.comm = MpiCommunicator(comm)
        # Every rank checks every other rank's collective order (cheap: one allgather),
        # then all sub-communicators are created before the first step.
        orders = self.comm.world.allgather(plan.collectives)
        check_collective_order(dict(enumerate(orders)))
        self.comm.prepare({c.group for calls in orders for c in calls})
        config = (config or SessionConfig()).for_sessions(plan.num_segments)
        self._phased = plan if isinstance(plan, PhasedPlan) else None
        if isinstance(plan, PhasedPlan):
            self._micro = RankProgram(plan.micro, config)
            self._program = RankProgram(plan.step, config)
        else:
            self._program = RankProgram(plan, config)

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.comm.rank,)

    @property
    def is_root(self) -> bool:
        return self.comm.rank == 0

    def step(self, feeds: Mapping[int, Feeds]) -> dict[int, dict[str, np.ndarray]]:
        rank = self.comm.rank
        mine = feeds[rank]
        if self._phased is None:
            return {rank: self._program.run(mine, self.comm)}
        cut, dims = self._phased.cut, self._phased.micro_dims
        total: dict[str, np.ndarray] = {}
        for m in range(cut.batches):
            outs = self._micro.run(micro_feeds(mine, cut, dims, m), self.comm)
            accumulate(total, outs, cut)
            del outs
        rest = {n: v for n, v in mine.items() if n not in dims}
        return {rank: self._program.run({**rest, **total}, self.comm)}

    def enable_profiling(self) -> dict[int, StepClock]:
        self._program.clock = StepClock()
        if self._phased is not None:
            self._micro.clock = self._program.clock
        return {self.comm.rank: self._program.clock}

    def gather(self, per_rank: Mapping[int, Any]) -> dict[int, Any] | None:
        gathered = self.comm.world.gather(per_rank[self.comm.rank], root=0)
        return dict(enumerate(gathered)) if gathered is not None else None

    def barrier(self) -> None:
        self.comm.barrier()
