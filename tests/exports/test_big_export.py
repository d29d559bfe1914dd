"""A real export over protobuf's 2 GB limit: imported, compiled for 2 devices, verified.

A Llama-style transformer (tests/exports/models.py, HuggingFace-style code) with
617 M random parameters (2.3 GiB of float32) is exported by
``torch.onnx.export(dynamo=True, external_data=True)``; ``tensoropt compile
--devices 2 --plan megatron`` must import it reading the weights in place (its peak
resident memory stays under half the weights) and write the per-device shards;
``tensoropt run --steps 1 --verify`` must then match the unpartitioned step. Batch
and sequence are tiny: the weights are what is big. Each phase runs in its own
process (so the test process never holds the weights) and its peak memory is read
from ``getrusage``. Needs 16 GB of available memory and 8 GB of disk; skipped with
the reason otherwise.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxscript")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DIM, HEADS, LAYERS, HIDDEN = 2048, 16, 12, 5632  # 12 x (4 x 2048^2 + 3 x 2048 x 5632)
MIN_PARAMS = 600_000_000
NEED_MEMORY = 16 * 2**30
NEED_DISK = 8 * 2**30


def _available_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def export_big(path: str) -> None:
    """Export the big Llama (run in a child process: torch holds the weights there)."""
    import warnings

    import torch

    from tests.exports.models import BATCH, SEQ, VOCAB, Llama

    torch.manual_seed(0)
    model = Llama(vocab=VOCAB, dim=DIM, heads=HEADS, layers=LAYERS, hidden=HIDDEN).eval()
    inputs = {
        "input_ids": torch.randint(0, VOCAB, (BATCH, SEQ)),
        "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long),
    }
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (), path, kwargs=inputs, input_names=list(inputs),
            dynamo=True, external_data=True,
        )  # fmt: skip


def _child(argv: list[str]) -> tuple[str, float]:
    """Run ``argv`` in a child process; (stdout, its peak resident memory in bytes)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    assert proc.returncode == 0, f"{argv[:4]} failed:\n{proc.stderr[-3000:]}"
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # ru_maxrss of children is the largest of any child so far: only a new maximum is
    # this child's own peak; otherwise it was at most the old maximum.
    return proc.stdout, max(peak, before) * 1024.0


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "tensoropt", *args]


def test_an_export_over_2gb_compiles_and_verifies(tmp_path):
    available = _available_memory()
    if available < NEED_MEMORY:
        pytest.skip(f"needs {NEED_MEMORY / 2**30:.0f} GB of available memory, has "
                    f"{available / 2**30:.1f} GB")  # fmt: skip
    if shutil.disk_usage(tmp_path).free < NEED_DISK:
        pytest.skip(f"needs {NEED_DISK / 2**30:.0f} GB of free disk in {tmp_path}")
    model = tmp_path / "llama.onnx"
    code = f"from tests.exports.test_big_export import export_big; export_big({str(model)!r})"
    _child([sys.executable, "-c", code])

    proto = onnx.load(str(model), load_external_data=False)  # the graph, no weights
    params = sum(int(np.prod(t.dims, dtype=np.int64)) for t in proto.graph.initializer)
    weight_bytes = sum(p.stat().st_size for p in tmp_path.iterdir() if p.name != model.name)
    assert params > MIN_PARAMS, params
    assert weight_bytes > 2 * 10**9, "the export should hold more than protobuf's 2 GB"
    assert model.stat().st_size < 10 * 2**20, "the weights should be external data"

    out = tmp_path / "out"
    _, compile_rss = _child(
        _cli("compile", str(model), "--devices", "2", "--plan", "megatron", "--optimizer",
             "sgd", "--momentum", "0", "--lr", "0.01", "-o", str(out))
    )  # fmt: skip
    assert compile_rss < weight_bytes / 2, (
        f"compile peaked at {compile_rss / 2**30:.2f} GiB for {weight_bytes / 2**30:.2f} GiB "
        "of weights: import or compile copied the weights"
    )
    manifest = json.loads((out / "manifest.json").read_text())
    shards = [out / r["data"] for r in manifest["ranks"]]
    assert all(s.is_file() for s in shards)
    # megatron shards the attention and MLP blocks: each rank holds about half
    assert all(s.stat().st_size < 0.6 * weight_bytes for s in shards), [
        s.stat().st_size for s in shards
    ]

    stdout, _ = _child(
        _cli("run", str(out), "--steps", "1", "--verify", "--json", "--threads", "2")
    )
    report = json.loads(stdout)["verify"]
    assert report["ok"], report
    assert len(report["per_step"]) == 1
