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
from tensoropt.runtime.profiling import StepClock, now
from tensoropt.runtime.program import RankProgram, SessionConfig, check_collective_order
from tensoropt.runtime.split import SplitPlan, shared_weights, split_graph

Feeds = Mapping[str, np.ndarray]


class Engine(Protocol):
    @property
    def ranks(self) -> tuple[int, ...]: ...

    @property
    def is_root(self) -> bool: ...

    def step(self, feeds: Mapping[int, Feeds]) -> dict[int, dict[str, np.ndarray]]: ...

    def gather(self, per_rank: Mapping[int, Any]) -> dict[int, Any] | None: ...

    def enable_profiling(self) -> dict[int, StepClock]: ...


def load_device(manifest: Manifest, rank: int) -> onnx.ModelProto:
    """Rank ``rank``'s device graph without its weight bytes (they stay in its data file)."""
    return load_graph(manifest.device_path(rank))


def fed_names(manifest: Manifest) -> set[str]:
    """Inputs fed every step: everything the manifest describes."""
    return set(manifest.inputs)


def split_rank(manifest: Manifest, model: onnx.ModelProto, rank: int) -> SplitPlan:
    """Split one rank's graph; its shared constants are read once from OUTDIR."""
    fed = fed_names(manifest)
    weights = shared_weights(model, fed, manifest.outdir)
    return split_graph(model, rank, manifest.world_size, fed, weights)


def split_all(manifest: Manifest, models: Mapping[int, onnx.ModelProto]) -> dict[int, SplitPlan]:
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
            state[name] = read_initializer(inits[name], manifest.outdir)
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

    def __init__(self, plans: Mapping[int, SplitPlan], config: SessionConfig | None = None):
        sessions = sum(p.num_segments for p in plans.values())
        config = (config or SessionConfig()).for_sessions(sessions)
        self._programs = {r: RankProgram(plans[r], config) for r in sorted(plans)}
        self._world = LocalWorld(len(plans))
        _check_lockstep(plans)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(self._programs)

    @property
    def is_root(self) -> bool:
        return True

    def step(self, feeds: Mapping[int, Feeds]) -> dict[int, dict[str, np.ndarray]]:
        envs = {r: p.begin(feeds[r]) for r, p in self._programs.items()}
        first = next(iter(self._programs.values()))
        for i in range(first.num_stages):
            for r, p in self._programs.items():
                p.run_segment(i, envs[r])
            for j in range(len(first.plan.stages[i].collectives)):
                calls = {r: p.plan.stages[i].collectives[j] for r, p in self._programs.items()}
                t0 = now()
                outs = self._world.run_batched(
                    calls, {r: envs[r][c.input] for r, c in calls.items()}
                )
                for r, c in calls.items():
                    envs[r][c.output] = outs[r]
                self._add_comm(now() - t0)
                for r, p in self._programs.items():
                    p.release_input(i, j, envs[r])
            for r, p in self._programs.items():
                p.release(i, envs[r])
        return {r: p.finish(envs[r]) for r, p in self._programs.items()}

    def gather(self, per_rank: Mapping[int, Any]) -> dict[int, Any] | None:
        return dict(per_rank)

    def enable_profiling(self) -> dict[int, StepClock]:
        """One clock per rank; a batched collective counts for every rank (lockstep)."""
        for p in self._programs.values():
            p.clock = StepClock()
        return {r: p.clock for r, p in self._programs.items()}

    def _add_comm(self, seconds: float) -> None:
        for p in self._programs.values():
            if p.clock is not None:
                p.clock.add_comm(seconds)


def _check_lockstep(plans: Mapping[int, SplitPlan]) -> None:
    ref_rank = min(plans)
    ref = [len(s.collectives) for s in plans[ref_rank].stages]
    for r, plan in plans.items():
        shape = [len(s.collectives) for s in plan.stages]
        if shape != ref:
            raise TensorOptError(
                f"rank {r}: its graph splits into stages with {shape} collectives, rank "
                f"{ref_rank} into {ref}; device graphs must have the same structure; "
                "recompile the model"
            )


class MpiEngine:
    """This process's single MPI rank."""

    def __init__(self, plan: SplitPlan, comm: Any = None, config: SessionConfig | None = None):
        from tensoropt.runtime.mpi_comm import MpiCommunicator

        self.comm = MpiCommunicator(comm)
        # Every rank checks every other rank's collective order (cheap: one allgather),
        # then all sub-communicators are created before the first step.
        orders = self.comm.world.allgather(plan.collectives)
        check_collective_order(dict(enumerate(orders)))
        self.comm.prepare({c.group for calls in orders for c in calls})
        config = (config or SessionConfig()).for_sessions(plan.num_segments)
        self._program = RankProgram(plan, config)

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.comm.rank,)

    @property
    def is_root(self) -> bool:
        return self.comm.rank == 0

    def step(self, feeds: Mapping[int, Feeds]) -> dict[int, dict[str, np.ndarray]]:
        rank = self.comm.rank
        return {rank: self._program.run(feeds[rank], self.comm)}

    def enable_profiling(self) -> dict[int, StepClock]:
        self._program.clock = StepClock()
        return {self.comm.rank: self._program.clock}

    def gather(self, per_rank: Mapping[int, Any]) -> dict[int, Any] | None:
        gathered = self.comm.world.gather(per_rank[self.comm.rank], root=0)
        return dict(enumerate(gathered)) if gathered is not None else None
