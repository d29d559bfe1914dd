"""Where a rank's onnxruntime tensors live: one CPU memory pool per process.

A rank's step is split at its collectives into compute segments, one onnxruntime
session each. By default every session owns a CPU arena that keeps its high-water
mark, so a rank would hold the *sum* of its segments' peaks instead of the peak of
its step, unlike a real device with one memory pool. :class:`ArenaMode` chooses how
sessions get memory; the default, ``SHARED``, registers one arena on onnxruntime's
process-wide environment (``create_and_register_allocator``) and lets every segment
session use it (session config ``session.use_env_allocators=1``). The arena grows by
exactly what is requested (``kSameAsRequested``), so its size follows the step's
real peak instead of rounding up to powers of two. Measurements behind the choice:
docs/design/runtime.md, "Memory: one arena per rank".

The environment is per process, and onnxruntime offers no way to unregister an
allocator, so the first registration in a process wins: :func:`ensure_shared_arena`
registers at most once and reports a later request for another growth policy.
"""

from __future__ import annotations

import enum
import logging
import threading

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

log = logging.getLogger(__name__)


class ArenaMode(enum.Enum):
    """How a process's segment sessions get CPU memory."""

    SHARED = "shared"  # one env arena per process, grows by the requested size
    SHARED_POW2 = "shared-pow2"  # one env arena per process, onnxruntime's doubling growth
    PER_SESSION = "per-session"  # onnxruntime's default: an arena per session
    NONE = "none"  # no arena: every tensor comes from the system allocator

    @property
    def shared(self) -> bool:
        return self in (ArenaMode.SHARED, ArenaMode.SHARED_POW2)


# onnxruntime's ArenaExtendStrategy values (OrtArenaCfg "arena_extend_strategy").
_EXTEND = {ArenaMode.SHARED: 1, ArenaMode.SHARED_POW2: 0}  # 1 = kSameAsRequested, 0 = pow2

_lock = threading.Lock()
_registered: ArenaMode | None = None
_trimmer: _Trimmer | None = None


def ensure_shared_arena(mode: ArenaMode) -> ArenaMode:
    """Register this process's shared CPU arena (once) and return the mode in effect.

    ``mode`` must be a shared mode. The first call registers an arena with that
    growth policy; later calls return the registered mode (with a warning when it
    differs from ``mode``: onnxruntime cannot replace an environment allocator).
    """
    global _registered
    if not mode.shared:
        raise ValueError(f"ensure_shared_arena: {mode} is not a shared arena mode")
    with _lock:
        if _registered is None:
            info = ort.OrtMemoryInfo(
                "Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT
            )
            cfg = ort.OrtArenaCfg({"arena_extend_strategy": _EXTEND[mode]})
            ort.create_and_register_allocator(info, cfg)
            _registered = mode
            log.debug("registered the process's shared CPU arena (%s)", mode.value)
        elif _registered is not mode:
            log.warning(
                "onnxruntime's shared CPU arena of this process was registered as %r; "
                "%r was asked for and cannot replace it (one registration per process)",
                _registered.value,
                mode.value,
            )
        return _registered


def registered_arena() -> ArenaMode | None:
    """The shared arena mode registered in this process, or None before the first."""
    return _registered


def apply_arena(opts: ort.SessionOptions, mode: ArenaMode) -> ArenaMode:
    """Set ``opts`` so a session gets its memory as ``mode`` says; returns the mode in effect."""
    if mode is ArenaMode.NONE:
        opts.enable_cpu_mem_arena = False
        return mode
    if mode is ArenaMode.PER_SESSION:
        return mode
    effective = ensure_shared_arena(mode)
    opts.add_session_config_entry("session.use_env_allocators", "1")
    return effective


def trim_shared_arena() -> bool:
    """Return the shared arena's free regions to the OS (its ``malloc_trim``).

    The arena keeps every region it ever grew. ``run --profile`` calls this when its
    step loop starts, so that regions left by session construction or by an earlier
    run in this process (tests, the local backend) do not hide the step's own
    growth. onnxruntime shrinks arenas only at the end of a ``run`` that asks for it
    (run config ``memory.enable_memory_arena_shrinkage``), so this runs a one-element
    Identity session on the shared arena whose output is bound to a numpy buffer: no
    chunk of the arena is in use by it when the shrink happens. Returns False (and
    does nothing) when no shared arena is registered in this process.
    """
    global _trimmer
    with _lock:
        if _registered is None:
            return False
        if _trimmer is None:
            _trimmer = _Trimmer()
        _trimmer.run()
        return True


class _Trimmer:
    """The one-element Identity session that asks the shared arena to shrink."""

    def __init__(self) -> None:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
        graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "trim", [x], [y])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
        model.ir_version = min(model.ir_version, onnx.IR_VERSION)
        opts = ort.SessionOptions()
        opts.log_severity_level = 4  # errors come back as exceptions, said once
        opts.add_session_config_entry("session.use_env_allocators", "1")
        self._session = ort.InferenceSession(
            model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
        )
        self._x = np.zeros(1, np.float32)
        self._y = np.zeros(1, np.float32)
        self._binding = self._session.io_binding()
        self._binding.bind_cpu_input("x", self._x)
        self._binding.bind_ortvalue_output("y", ort.OrtValue.ortvalue_from_numpy(self._y))
        self._options = ort.RunOptions()
        self._options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")

    def run(self) -> None:
        self._session.run_with_iobinding(self._binding, self._options)
