"""What a calibrated profile was measured on: the machine, the libraries, the date."""

from __future__ import annotations

import datetime
import os
import platform
import socket
from importlib import metadata


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_bytes() -> int:
    """Physical memory of this machine (MemTotal), in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def machine_info() -> dict:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "host": socket.gethostname(),
        "cpu": _cpu_model(),
        "arch": platform.machine(),
        "cores": os.cpu_count() or 1,
        "memory_bytes": memory_bytes(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "load_average_1min": load,
    }


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def package_versions() -> dict:
    """The measuring libraries' versions (without loading MPI)."""
    return {name: _version(name) for name in ("onnxruntime", "numpy", "mpi4py", "mpich", "onnx")}


def versions() -> dict:
    out = package_versions()
    try:
        from mpi4py import MPI

        out["mpi_library"] = MPI.Get_library_version().splitlines()[0].strip()
    except Exception:  # no MPI library: the local backend still calibrates
        out["mpi_library"] = None
    return out


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
