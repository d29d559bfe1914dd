"""glibc malloc settings for the processes that run steps (tensoropt.runtime.malloc)."""

from __future__ import annotations

import subprocess
import sys

from tensoropt.runtime.malloc import MALLOC_ENV, child_env


def test_child_env_adds_the_settings_and_keeps_the_users():
    env = child_env({"PATH": "/bin", "MALLOC_TRIM_THRESHOLD_": "7"})
    assert env["MALLOC_MMAP_THRESHOLD_"] == MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]
    assert env["MALLOC_TRIM_THRESHOLD_"] == "7" and env["PATH"] == "/bin"


def test_tune_process_applies_once_on_glibc():
    code = "from tensoropt.runtime.malloc import tune_process;print(tune_process(), tune_process())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]
