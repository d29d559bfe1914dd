"""A real export over protobuf's 2 GB limit: imported, compiled for 2 devices, verified.

A Llama-style transformer (tests/exports/models.py, HuggingFace-style code) with
617 M random parameters (2.3 GiB of float32) is exported by
``torch.onnx.export(dynamo=True, external_data=True)``; ``tensoropt compile
--devices 2 --plan megatron`` must import it reading the weights in place (its peak
resident memory stays under half the weights) and write the per-device shards;
``tensoropt run --steps 1 --verify`` must then match the unpartitioned step after a
step large enough to move the weights well above float32 rounding. Batch
and sequence are tiny: the weights are what is big. Each phase runs in its own
process (so the test process never holds the weights) and its peak memory is read
from ``getrusage``. Needs 16 GB of available memory and 12 GB of disk; skipped with
the reason otherwise.
"""

from __future__ import annotations

import json
import os
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
NEED_DISK = 12 * 2**30
LR = 1.0  # a large step, so that the update stands well above float32 rounding
# The exporter folds the causal mask (torch.finfo.min above the diagonal) into an
# initializer named "clone", which the training step would train like a weight: its
# 3.4e38 entries would then set --verify's parameter floor (1e-3 of the largest
# parameter) and hide every other difference. It is frozen.
FREEZE = "^clone$"


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


# Runs argv[1:] and prints the largest resident memory of that child (and its own
# children) in KiB: a fresh process's RUSAGE_CHILDREN covers that child alone.
_MEASURE = (
    "import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
    "sys.exit(rc)"
)


def _child(argv: list[str]) -> tuple[str, float]:
    """Run ``argv`` in a child process; (stdout, its peak resident memory in bytes)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-c", _MEASURE, *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    assert proc.returncode == 0, f"{argv[:4]} failed:\n{proc.stderr[-3000:]}"
    return proc.stdout, int(proc.stderr.strip().splitlines()[-1]) * 1024.0


def _update_size(out: Path, saved: Path) -> float:
    """max|trained - initial| over the largest initial weight, one tensor at a time."""
    from tensoropt.runtime.engine import load_device
    from tensoropt.runtime.external import read_initializer
    from tensoropt.runtime.manifest import assemble, load_outdir

    manifest = load_outdir(out, check_files=False)
    inits = [
        {t.name: t for t in load_device(manifest, r).graph.initializer}
        for r in range(manifest.world_size)
    ]
    moved = scale = 0.0
    with np.load(saved) as trained:
        for name in trained.files:
            pieces = {r: read_initializer(i[name], out) for r, i in enumerate(inits)}
            before = assemble(pieces, manifest.inputs[name], manifest)
            moved = max(moved, float(np.max(np.abs(trained[name] - before))))
            scale = max(scale, float(np.max(np.abs(before))))
    return moved / scale


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
             "sgd", "--momentum", "0", "--lr", str(LR), "--freeze", FREEZE, "-o", str(out))
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

    saved = tmp_path / "trained.npz"
    stdout, run_rss = _child(
        _cli("run", str(out), "--steps", "1", "--verify", "--json", "--threads", "2",
             "--save-params", str(saved))
    )  # fmt: skip
    report = json.loads(stdout)["verify"]
    assert report["ok"], report
    assert len(report["per_step"]) == 1
    moved = _update_size(out, saved)
    assert moved > 1e-3, f"the step moved the weights by only {moved:.1e} of their scale"
    print(
        f"\n{params:,} parameters, {weight_bytes / 2**30:.2f} GiB; compile peak RSS "
        f"{compile_rss / 2**30:.2f} GiB; run --verify peak RSS {run_rss / 2**30:.2f} GiB; "
        f"rel. error loss {report['max_rel_error_loss']:.1e}, params "
        f"{report['max_rel_error_params']:.1e}; update {moved:.1e} of the largest weight"
    )
