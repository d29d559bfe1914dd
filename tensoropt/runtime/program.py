"""Executable form of one rank's device graph: sessions per segment, plus collectives.

:class:`RankProgram` owns one onnxruntime InferenceSession (CPU EP) per compute
segment of a :class:`~tensoropt.runtime.split.SplitPlan`. It runs either on its
own with a :class:`~tensoropt.runtime.comm.Communicator` (``run``: the MPI worker)
or stage by stage under a driver that holds every rank (``begin`` /
``run_segment`` / ``release`` / ``finish``: the local lockstep engine).

:func:`check_collective_order` is the pre-check that keeps ranks from
deadlocking: every rank must issue the same sequence of collective kinds, and the
members of each group must agree on the group at every position.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from tensoropt.errors import TensorOptError
from tensoropt.runtime.arena import ArenaMode, apply_arena
from tensoropt.runtime.collectives import CollectiveCall
from tensoropt.runtime.comm import Communicator, LocalWorld, dispatch
from tensoropt.runtime.profiling import StepClock, cpu_now, now
from tensoropt.runtime.split import SplitPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """onnxruntime knobs for segment sessions (0 threads = onnxruntime's default)."""

    intra_op_threads: int = 0
    inter_op_threads: int = 0
    # onnxruntime's worker threads spin after each run. That pays off for one session
    # run back to back, but with several sessions taking turns (segments, ranks in
    # lockstep, MPI polling) the spinning threads steal the cores: a 4-rank local run
    # of the A2A case took 0.9 s with spinning and 0.02 s without.
    allow_spinning: bool = True
    # Where tensors live: by default one arena per process shared by every segment
    # session, so a rank holds the peak of its step, not the sum of its segments'
    # peaks (tensoropt.runtime.arena; measurements in docs/design/runtime.md).
    arena: ArenaMode = ArenaMode.SHARED
    # onnxruntime's memory pattern pre-plans one block per session for all of its
    # intermediate tensors, sized by its planner: 20-30 MiB more than allocating each
    # tensor from the arena on gpt-small, at the same step time (docs/design/runtime.md).
    memory_pattern: bool = False

    def options(self) -> ort.SessionOptions:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.intra_op_threads
        opts.inter_op_num_threads = self.inter_op_threads
        opts.log_severity_level = 4  # errors come back as exceptions, said once
        opts.enable_mem_pattern = self.memory_pattern
        apply_arena(opts, self.arena)
        if not self.allow_spinning:
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
            opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
        return opts

    def for_sessions(self, count: int) -> SessionConfig:
        """This config, with spinning only when ``count`` (sessions taking turns) is 1."""
        return dataclasses.replace(self, allow_spinning=self.allow_spinning and count <= 1)


class RankProgram:
    """One rank's compiled step: a session per segment and the collective calls."""

    def __init__(self, plan: SplitPlan, config: SessionConfig | None = None) -> None:
        self.plan = plan
        self.clock: StepClock | None = None  # set by --profile: times segments, collectives
        opts = (config or SessionConfig()).options()
        self._sessions: list[ort.InferenceSession | None] = []
        for stage in plan.stages:
            seg = stage.segment
            if seg is None:
                self._sessions.append(None)
                continue
            try:
                sess = ort.InferenceSession(
                    seg.model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
                )
            except Exception as exc:  # onnxruntime raises its own untyped errors
                raise TensorOptError(
                    f"rank {plan.rank}: onnxruntime rejected compute segment {seg.index}: "
                    f"{exc}; recompile the model"
                ) from exc
            self._sessions.append(sess)

    @property
    def rank(self) -> int:
        return self.plan.rank

    @property
    def sessions(self) -> tuple[ort.InferenceSession, ...]:
        """The compute segments' sessions, in stage order."""
        return tuple(s for s in self._sessions if s is not None)

    @property
    def num_stages(self) -> int:
        return len(self.plan.stages)

    def begin(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The value table a step starts from: constants plus this step's feeds."""
        missing = [n for n in self.plan.feeds if n not in feeds]
        if missing:
            raise TensorOptError(
                f"rank {self.rank}: no value fed for graph input(s) {missing}; "
                "the manifest does not describe them; recompile the model with `tensoropt compile`"
            )
        env = dict(self.plan.weights)  # shared constants: fed to segments, never copied
        env.update(self.plan.constants)
        env.update(feeds)
        return env

    def run_segment(self, i: int, env: dict[str, np.ndarray]) -> None:
        """Run the compute segment of stage ``i`` (if any), adding its outputs to ``env``."""
        sess = self._sessions[i]
        seg = self.plan.stages[i].segment
        if sess is None or seg is None:
            return
        t0, c0 = now(), cpu_now()
        if seg.in_place:
            results = _run_in_place(sess, seg, env)
        else:
            results = sess.run(list(seg.outputs), {n: env[n] for n in seg.inputs})
        if self.clock is not None:
            self.clock.add_compute(now() - t0, cpu_now() - c0)
        env.update(zip(seg.outputs, results, strict=True))

    def release(self, i: int, env: dict[str, np.ndarray]) -> None:
        """Drop values that no stage after ``i`` reads."""
        for name in self.plan.stages[i].release:
            env.pop(name, None)

    def release_input(self, i: int, j: int, env: dict[str, np.ndarray]) -> None:
        """Drop the input of collective ``j`` of stage ``i`` if nothing later reads it."""
        for name in self.plan.stages[i].release_after[j]:
            env.pop(name, None)

    def finish(self, env: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The graph outputs of a finished step."""
        return {name: env[name] for name in self.plan.outputs}

    def run(self, feeds: Mapping[str, np.ndarray], comm: Communicator) -> dict[str, np.ndarray]:
        """One whole step on this rank, collectives through ``comm``."""
        env = self.begin(feeds)
        for i, stage in enumerate(self.plan.stages):
            self.run_segment(i, env)
            for j, call in enumerate(stage.collectives):
                t0 = now()
                env[call.output] = dispatch(comm, call, env[call.input])
                if self.clock is not None:
                    self.clock.add_comm(now() - t0)
                self.release_input(i, j, env)
            self.release(i, env)
        return self.finish(env)


def _run_in_place(sess: ort.InferenceSession, seg, env: Mapping[str, np.ndarray]) -> list:
    """Run ``seg`` with each in-place output bound to its input's buffer
    (``runtime.inplace``); an input that is not a writable C-contiguous array keeps its
    output apart. The other outputs are onnxruntime's, as ``session.run`` returns them."""
    binding = sess.io_binding()
    # np.require keeps a 0-d input 0-d (np.ascontiguousarray would make it 1-d);
    # the list keeps any copy alive through the run
    fed = [np.require(env[name], requirements="C") for name in seg.inputs]
    for name, value in zip(seg.inputs, fed, strict=True):
        binding.bind_cpu_input(name, value)
    over = {}
    for out, src in seg.in_place:
        buf = env[src]
        if isinstance(buf, np.ndarray) and buf.flags.writeable and buf.flags.c_contiguous:
            over[out] = buf
    for name in seg.outputs:
        buf = over.get(name)
        if buf is None:
            binding.bind_output(name, "cpu")
        else:
            binding.bind_output(name, "cpu", 0, buf.dtype.type, list(buf.shape), buf.ctypes.data)
    sess.run_with_iobinding(binding)
    values = binding.get_outputs()
    return [over[n] if n in over else values[i].numpy() for i, n in enumerate(seg.outputs)]


def check_collective_order(by_rank: Mapping[int, Sequence[CollectiveCall]]) -> None:
    """Refuse ranks that would issue mismatched collectives (a deadlock or garbage).

    ``by_rank`` maps each rank to its collectives in issue order (``SplitPlan.collectives``
    or :func:`~tensoropt.runtime.split.collective_order`). The lowest rank's sequence
    of kinds is the reference; every rank must match it position by position, and
    each group at each position must be named identically by all of its members.
    """
    ref = by_rank[min(by_rank)]
    for rank, calls in sorted(by_rank.items()):
        for pos in range(max(len(calls), len(ref))):
            mine = calls[pos] if pos < len(calls) else None
            theirs = ref[pos] if pos < len(ref) else None
            if mine is None or theirs is None or mine.kind is not theirs.kind:
                raise TensorOptError(
                    f"rank {rank}: collective #{pos} is {_desc(mine)} but rank {min(by_rank)} "
                    f"issues {_desc(theirs)}; all ranks must issue the same collectives in "
                    "the same order; recompile the model"
                )
            _check_group_agreement(by_rank, rank, pos)


def _check_group_agreement(
    by_rank: Mapping[int, Sequence[CollectiveCall]], rank: int, pos: int
) -> None:
    call = by_rank[rank][pos]
    for member in call.group:
        if member not in by_rank:
            continue  # a rank this process does not hold (MPI pre-check holds all)
        other = by_rank[member][pos]
        if other.group != call.group:
            raise TensorOptError(
                f"rank {rank}: collective #{pos} ({call.describe()}) does not match rank "
                f"{member}, which uses group {list(other.group)} in node "
                f"{other.node_name!r}; recompile the model"
            )


def _desc(call: CollectiveCall | None) -> str:
    return "nothing" if call is None else call.describe()


def lockstep(
    world: LocalWorld,
    programs: Mapping[int, RankProgram],
    feeds: Mapping[int, Mapping[str, np.ndarray]],
    add_comm: Callable[[float], None],
) -> dict[int, dict[str, np.ndarray]]:
    """One run of ``programs`` (one per rank, same structure), stage by stage on every
    rank; each batch of collectives goes through ``world`` and its time to ``add_comm``."""
    envs = {r: p.begin(feeds[r]) for r, p in programs.items()}
    first = next(iter(programs.values()))
    for i in range(first.num_stages):
        for r, p in programs.items():
            p.run_segment(i, envs[r])
        for j in range(len(first.plan.stages[i].collectives)):
            calls = {r: p.plan.stages[i].collectives[j] for r, p in programs.items()}
            t0 = now()
            outs = world.run_batched(calls, {r: envs[r][c.input] for r, c in calls.items()})
            for r, c in calls.items():
                envs[r][c.output] = outs[r]
            add_comm(now() - t0)
            for r, p in programs.items():
                p.release_input(i, j, envs[r])
        for r, p in programs.items():
            p.release(i, envs[r])
    return {r: p.finish(envs[r]) for r, p in programs.items()}


def check_lockstep(plans: Mapping[int, SplitPlan]) -> None:
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
