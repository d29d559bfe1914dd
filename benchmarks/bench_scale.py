"""Compile at real scale: peak memory, data-file bytes and time against a plain disk write.

1. GPT-2 XL shape: the zoo ``gpt --preset paper --layers 48 --hidden 1600 --heads 25``
   (1.56 B parameters, 6.2 GB of float32 weights, zeros in a sparse ``.onnx.data``),
   compiled with ``tensoropt compile --devices 8`` for ``--plan megatron`` and
   ``--plan data-parallel``, each in a fresh process. Reported per plan:

   - peak RSS of the compile process (``os.wait4``'s rusage of that child); target
     <= 4 GiB;
   - the bytes of the device data files against the per-device parameter shards the
     manifest implies (shapes by the slicing rule): external tensor bytes + inline
     small shards must equal the shards exactly; the rest of each file is alignment;
     the disk blocks the files occupy (zero weights are holes);
   - compile wall time against the time to write the data files' bytes to the same
     disk in this run (non-zero bytes, 16 MiB writes, no fsync, as compile). The
     write rate is measured over ``--write-sample-gib`` (4 GiB) and scaled to the
     data files' bytes: a longer write only gets slower once the page cache fills, so
     the scaled time flatters the plain write. Target: compile <= 3x the write.

   The zoo's zeros are holes that compile skips, so a third row compiles the same
   model with its data file overwritten by non-zero bytes (``megatron, dense
   weights``: 6.1 GiB read, 10.4 GiB written for real); data-parallel with dense
   weights (49 GiB written) is left out for the disk's sake.

2. Planning size: a Llama-8B-sized knob set of the zoo gpt (32 layers, hidden 4096,
   32 heads, vocab 128256, seq 2048, batch 1; the zoo has GPT-style blocks, so this is
   Llama-3-8B's width, depth and vocabulary, not its gated MLP or grouped attention),
   compiled for 8 devices with ``--plan megatron``: per-device file sizes. Skipped
   with a message when the disk has less than ``--min-free-gib`` free.

Everything is written under a temporary directory (``--dir``) and deleted at the end.

Usage: python benchmarks/bench_scale.py [--skip-planning] [--dir DIR] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from results import write_section  # noqa: E402  (benchmarks/ is on sys.path)

SECTION = "## Compile at scale"
GIB = 1 << 30
MIB = 1 << 20
RSS_TARGET = 4 * GIB
RATIO_TARGET = 3.0
XL = ("--layers", "48", "--hidden", "1600", "--heads", "25")
LLAMA = ("--layers", "32", "--hidden", "4096", "--heads", "32", "--vocab", "128256",
         "--seq", "2048", "--batch", "1")  # fmt: skip


@dataclass(frozen=True, slots=True)
class Run:
    wall_s: float
    peak_rss: int


@dataclass(frozen=True, slots=True)
class Sizes:
    """Bytes of one output directory's device data files against the parameter shards."""

    shards: int  # sum over ranks of the parameter shards (manifest shapes)
    external: int  # sum of the external tensors' lengths in the device graphs
    inline: int  # parameter shards small enough to stay inside the graphs
    data_files: int  # sum of the data files' sizes
    allocated: int  # disk blocks of the data files
    per_rank: tuple[int, ...]  # data file size per rank
    graphs: int  # sum of the device .onnx sizes


def tensoropt(*argv: str) -> Run:
    """``python -m tensoropt ARGV`` in a fresh process: wall time and its peak RSS."""
    with tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "tensoropt", *argv],
                                stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            err.seek(0)
            sys.exit(f"tensoropt {' '.join(argv)} failed:\n{err.read()}")
    return Run(wall, usage.ru_maxrss * 1024)


def sizes(outdir: Path) -> Sizes:
    import numpy as np
    import onnx

    from tensoropt.runtime.manifest import block_of

    manifest = json.loads((outdir / "manifest.json").read_text())
    mesh = manifest["mesh"]["shape"]
    params = manifest["step"]["params"]
    shards = external = inline = data_total = allocated = graphs = 0
    per_rank = []
    for entry in manifest["ranks"]:
        for name in params:
            info = manifest["inputs"][name]
            block = block_of(info["global_shape"], info["placements"], mesh, entry["coords"])
            count = math.prod(s.stop - s.start for s in block)
            shards += count * np.dtype(info["dtype"]).itemsize
        graph_path = outdir / entry["file"]
        graphs += graph_path.stat().st_size
        proto = onnx.load(str(graph_path), load_external_data=False)
        for t in proto.graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                external += int({e.key: e.value for e in t.external_data}["length"])
            elif t.name in params:
                inline += len(t.raw_data) or onnx.numpy_helper.to_array(t).nbytes
        data = outdir / entry["data"] if entry.get("data") else None
        size = data.stat().st_size if data else 0
        per_rank.append(size)
        data_total += size
        allocated += data.stat().st_blocks * 512 if data else 0
    return Sizes(shards, external, inline, data_total, allocated, tuple(per_rank), graphs)


def compile_row(args, model: Path, plan: str, label: str, rate: float):
    out = model.with_name(f"out-{plan}")
    compiled = tensoropt("compile", str(model), "--devices", str(args.devices), "--plan", plan,
                         "-o", str(out))  # fmt: skip
    s = sizes(out)
    shutil.rmtree(out)
    print(label, compiled, s, file=sys.stderr)
    return label, compiled, s, s.data_files / rate


def densify(model: Path) -> None:
    """Overwrite the zoo model's sparse zeros with non-zero values (a real data file)."""
    import onnx

    proto = onnx.load(str(model), load_external_data=False)
    pattern = (bytes(range(1, 256)) * (16 * MIB // 255 + 1))[: 16 * MIB]
    with open(model.with_name(model.name + ".data"), "r+b") as f:
        for t in proto.graph.initializer:
            entries = {e.key: e.value for e in t.external_data}
            if not entries:
                continue
            offset, length = int(entries.get("offset", 0)), int(entries["length"])
            f.seek(offset)
            for start in range(0, length, len(pattern)):
                f.write(pattern[: min(len(pattern), length - start)])


def write_rate(directory: Path, sample: int) -> float:
    """Bytes per second of writing ``sample`` non-zero bytes to a new file (no fsync)."""
    block = bytes(range(256)) * (16 * MIB // 256)
    path = directory / "write-rate.bin"
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(sample // len(block)):
            f.write(block)
    seconds = time.perf_counter() - start
    path.unlink()
    return sample // len(block) * len(block) / seconds


def free_bytes(directory: Path) -> int:
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: tmp)")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--write-sample-gib", type=float, default=4.0)
    ap.add_argument("--min-free-gib", type=float, default=20.0)
    ap.add_argument("--skip-planning", action="store_true", help="skip the Llama-8B-size run")
    ap.add_argument("--skip-dense", action="store_true", help="skip the dense-weights run")
    ap.add_argument("--write", action="store_true", help=f"update '{SECTION}' in RESULTS.md")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.dir))
    try:
        text = run(args, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(text)
    if args.write:
        write_section(SECTION, text)


def run(args, base: Path) -> str:
    free = free_bytes(base)
    if free < args.min_free_gib * GIB:
        sys.exit(f"{base}: {free / GIB:.1f} GiB free, need {args.min_free_gib} GiB; use --dir")
    lines = [SECTION, ""]
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines.append(
        f"`python benchmarks/bench_scale.py` -- {when}, {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{free / GIB:.0f} GiB free on the output disk at the start."
    )
    model = base / "xl.onnx"
    tensoropt("model", "gpt", "--preset", "paper", *XL, "-o", str(model))
    params = _params(model)
    lines += ["", f"(a) zoo gpt at GPT-2 XL shape (`--preset paper {' '.join(XL)}`): "
              f"{params:,} parameters, {params * 4 / GIB:.2f} GiB of float32 zeros in a "
              f"sparse data file; `compile --devices {args.devices}`, SGD with momentum, "
              "each compile in a fresh process.", ""]  # fmt: skip
    rows = []
    sample = int(args.write_sample_gib * GIB)
    rate = write_rate(base, sample)
    for plan in ("megatron", "data-parallel"):
        rows.append(compile_row(args, model, plan, plan, rate))
    if not args.skip_dense:
        densify(model)
        rows.append(compile_row(args, model, "megatron", "megatron, dense weights", rate))
    lines += [
        "| plan | compile s | peak RSS MiB | param shards GiB | external + inline GiB | "
        "data files GiB | on disk MiB | graphs MiB | plain write s | compile / write |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for plan, compiled, s, write_s in rows:
        lines.append(
            f"| {plan} | {compiled.wall_s:.1f} | {compiled.peak_rss / MIB:.0f} | "
            f"{s.shards / GIB:.3f} | {(s.external + s.inline) / GIB:.3f} | "
            f"{s.data_files / GIB:.3f} | {s.allocated / MIB:.1f} | {s.graphs / MIB:.1f} | "
            f"{write_s:.1f} | {compiled.wall_s / write_s:.2f} |"
        )
    lines.append("")
    lines.append(
        f"plain write: {rate / GIB:.2f} GiB/s, measured over {sample / GIB:.1f} GiB of "
        "non-zero bytes on the same disk in this run, scaled to the data files' bytes."
    )
    for plan, compiled, s, write_s in rows:
        agree = s.external + s.inline == s.shards
        lines.append(
            f"{plan}: peak RSS {compiled.peak_rss / GIB:.2f} GiB "
            f"({'meets' if compiled.peak_rss <= RSS_TARGET else 'misses'} <= 4 GiB); "
            f"external + inline bytes {'==' if agree else '!='} parameter shards "
            f"({s.external + s.inline:,} vs {s.shards:,}); data files - external = "
            f"{s.data_files - s.external:,} bytes of 4 KiB alignment; compile / write "
            f"{compiled.wall_s / write_s:.2f} "
            f"({'meets' if compiled.wall_s / write_s <= RATIO_TARGET else 'misses'} <= 3x)."
        )
    model.unlink()
    model.with_name(model.name + ".data").unlink()
    lines += ["", *planning(args, base)]
    return "\n".join(lines) + "\n"


def planning(args, base: Path) -> list[str]:
    head = (f"(b) planning size: zoo gpt `--preset paper {' '.join(LLAMA)}` (Llama-3-8B "
            f"width, depth and vocabulary, GPT-style blocks), `compile --devices "
            f"{args.devices} --plan megatron`")  # fmt: skip
    if args.skip_planning:
        return [f"{head}: skipped (--skip-planning)."]
    free = free_bytes(base)
    if free < args.min_free_gib * GIB:
        return [f"{head}: skipped, {free / GIB:.1f} GiB free (< {args.min_free_gib} GiB)."]
    model = base / "llama.onnx"
    tensoropt("model", "gpt", "--preset", "paper", *LLAMA, "-o", str(model))
    params = _params(model)
    out = base / "out-llama"
    compiled = tensoropt("compile", str(model), "--devices", str(args.devices), "--plan",
                         "megatron", "-o", str(out))  # fmt: skip
    s = sizes(out)
    shutil.rmtree(out)
    per = ", ".join(f"{b / GIB:.2f}" for b in s.per_rank)
    return [
        f"{head}: {params:,} parameters ({params * 4 / GIB:.1f} GiB of float32 zeros).",
        "",
        f"compile {compiled.wall_s:.1f} s, peak RSS {compiled.peak_rss / GIB:.2f} GiB; "
        f"device data files {per} GiB (total {s.data_files / GIB:.1f} GiB, "
        f"{s.allocated / MIB:.1f} MiB on disk: zero weights are holes); device graphs "
        f"{s.graphs / MIB / len(s.per_rank):.1f} MiB each; external + inline bytes "
        f"{'==' if s.external + s.inline == s.shards else '!='} parameter shards "
        f"({s.shards / GIB:.2f} GiB).",
    ]


def _params(model: Path) -> int:
    import onnx

    from tensoropt.models.io import zoo_info

    info = zoo_info(onnx.load(str(model), load_external_data=False))
    assert info is not None
    return info.params


if __name__ == "__main__":
    main()
