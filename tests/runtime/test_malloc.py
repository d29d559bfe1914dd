"""glibc malloc settings for the processes that run steps (tensoropt.runtime.malloc)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tensoropt.runtime.malloc import (
    HUGETLB,
    HUGETLB_TUNABLE,
    MALLOC_ENV,
    TUNABLES,
    child_env,
    spawn_environment,
)


def test_child_env_adds_the_settings_and_keeps_the_users():
    env = child_env({"PATH": "/bin", "MALLOC_TRIM_THRESHOLD_": "7"})
    assert env["MALLOC_MMAP_THRESHOLD_"] == MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]
    assert env["MALLOC_TRIM_THRESHOLD_"] == "7" and env["PATH"] == "/bin"


def test_tune_process_applies_once_on_glibc():
    code = "from tensoropt.runtime.malloc import tune_process;print(tune_process(), tune_process())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]


def test_child_env_adds_the_huge_page_tunable_to_the_users_tunables():
    assert child_env({})[TUNABLES] == HUGETLB_TUNABLE
    mine = "glibc.malloc.tcache_count=0"
    assert child_env({TUNABLES: mine})[TUNABLES] == f"{mine}:{HUGETLB_TUNABLE}"
    own = f"{mine}:{HUGETLB}=0"  # the user's own choice wins
    assert child_env({TUNABLES: own})[TUNABLES] == own


def test_spawn_environment_sets_the_settings_for_the_block_only(monkeypatch):
    monkeypatch.delenv(TUNABLES, raising=False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "7")
    with spawn_environment():
        assert os.environ[TUNABLES] == HUGETLB_TUNABLE
        assert os.environ["MALLOC_MMAP_THRESHOLD_"] == MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]
        assert os.environ["MALLOC_TRIM_THRESHOLD_"] == "7"
    assert TUNABLES not in os.environ and os.environ["MALLOC_TRIM_THRESHOLD_"] == "7"


# A child that mallocs 64 MiB (onnxruntime's buffers come from malloc) and touches it:
# how much of it the kernel backs with huge pages.
_HUGE_CHILD = """
import ctypes
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
size = 64 << 20
ctypes.memset(libc.malloc(size), 1, size)
rollup = open("/proc/self/smaps_rollup").read()
print(int(rollup.split("AnonHugePages:")[1].split()[0]) << 10)
"""


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text.split("[", 1)[1].split("]", 1)[0]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc tunables only")
def test_child_env_backs_malloc_memory_with_huge_pages():
    if _thp_mode() not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {_thp_mode()} on this machine")
    version = tuple(int(p) for p in platform.libc_ver()[1].split(".")[:2])
    if version < (2, 35):
        pytest.skip(f"glibc {version} predates glibc.malloc.hugetlb")

    def huge_bytes(env):
        cmd = [sys.executable, "-c", _HUGE_CHILD]
        return int(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout)

    plain = {k: v for k, v in os.environ.items() if k != TUNABLES}
    tuned = huge_bytes(child_env(plain))
    assert tuned >= 32 << 20, tuned  # most of the 64 MiB
    if _thp_mode() == "madvise":  # without the tunable, malloc's memory stays on 4 KiB pages
        assert huge_bytes(plain) < 8 << 20
