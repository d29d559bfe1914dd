"""Bad input to every command and flag: exit code 2, one line on stderr that names the
thing, no traceback, nothing on stdout and no file written (issue 15, "How it is
checked": the bad-input sweep).

Each case is ``(argv, fragment)``: ``argv`` may hold placeholders that the fixtures
below fill in; ``fragment`` must appear in the one error line. Output paths point into
an empty directory that must still be empty afterwards. ``--json`` flags are left out
(their convention is tested with the JSON output).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tensoropt.cli import main
from tensoropt.models import build_model, save_model


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """The files the cases refer to: a tiny model, a compiled 2-device output directory
    with a checkpoint at step 3, and a few malformed or misplaced files."""
    root = tmp_path_factory.mktemp("sweep")
    model = root / "mlp.onnx"
    save_model(build_model("mlp", "tiny"), str(model))
    outdir = root / "compiled"
    assert main(["compile", str(model), "--devices", "2", "--plan", "data-parallel",
                 "-o", str(outdir)]) == 0  # fmt: skip
    ckpt = root / "ckpt"
    assert main(["run", str(outdir), "--steps", "3", "--checkpoint", str(ckpt)]) == 0
    (root / "bad.json").write_text("{not json")
    (root / "garbage.onnx").write_bytes(b"\x00\xffnot an onnx model" * 10)
    (root / "a_file").write_text("x")
    foreign = root / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    np.savez(root / "wrong.npz", nothing=np.zeros(3))
    return {
        "model": str(model),
        "outdir": str(outdir),
        "plan": str(outdir / "plan.json"),
        "ckpt": str(ckpt),
        "bad_json": str(root / "bad.json"),
        "garbage": str(root / "garbage.onnx"),
        "a_file": str(root / "a_file"),
        "a_dir": str(root),
        "foreign": str(foreign),
        "wrong_npz": str(root / "wrong.npz"),
        "missing": str(root / "no-such-thing"),
    }


M, O, P, OUT = "{model}", "{outdir}", "{plan}", "{out}"
PICKED = ["compile", M, "--devices", "2", "--pick", "fastest"]
CASES: list[tuple[list[str], str]] = [
    # the command line itself
    (["frobnicate"], "invalid choice"),
    (["--bogus"], "unrecognized arguments"),
    # model
    (["model", "nosuch", "-o", f"{OUT}/m.onnx"], "nosuch"),
    (["model", "gpt", "--preset", "huge", "-o", f"{OUT}/m.onnx"], "huge"),
    (["model", "gpt", "--layers", "0", "-o", f"{OUT}/m.onnx"], "--layers"),
    (["model", "gpt", "--heads", "3", "-o", f"{OUT}/m.onnx"], "--heads"),
    (["model", "resnet50", "--seq", "8", "-o", f"{OUT}/m.onnx"], "--seq"),
    (["model", "gpt", "--layers", "two", "-o", f"{OUT}/m.onnx"], "--layers"),
    (["model", "gpt"], "-o"),
    (["model", "gpt", "-o", "/proc/m.onnx"], "/proc"),
    (["model", "gpt", "-o", f"{OUT}/nodir/m.onnx"], "does not exist"),
    (["model", "gpt", "-o", "{a_dir}"], "is a directory"),
    (["model", "gpt", "-o", ""], "give a file name"),
    (["model", "gpt", "--batch", "0", "-o", f"{OUT}/m.onnx"], "--batch"),
    # train
    (["train", "{missing}"], "no-such-thing"),
    (["train", P], "not a readable ONNX model"),
    (["train", "{garbage}"], "not a readable ONNX model"),
    (["train", M, "--steps", "0"], "--steps"),
    (["train", M, "--lr", "-1"], "--lr"),
    (["train", M, "--momentum", "1.5"], "--momentum"),
    (["train", M, "--freeze", ".*"], "--freeze"),
    (["train", M, "--trainable", "("], "--trainable"),
    (["train", M, "--data", "{missing}"], "no-such-thing"),
    (["train", M, "--data", "{wrong_npz}"], "wrong.npz"),
    (["train", M, "--save-params", "/proc/p.npz"], "--save-params"),
    (["train", M, "--export-step", f"{OUT}/nodir/s.onnx"], "--export-step"),
    (["train", M, "--input-shape", "x=8by4"], "--input-shape"),
    (["train", M, "--input-shape", "x=0x32"], "at least 1"),
    # mlp tiny's x is a static 8x32: a pin cannot resize what the weights are sized to
    (["search", M, "--devices", "2", "--input-shape", "x=4x3"], "give x=8x32"),
    (["search", M, "--devices", "2", "--input-shape", "x=16x32"], "dimension 0 is 8"),
    (["train", M, "--optimizer", "rmsprop"], "--optimizer"),
    (["train", M, "--threads", "0"], "--threads"),
    # search
    (["search", M, "--devices", "two"], "--devices"),
    (["search", M, "--devices", "3..5"], "3-5"),
    (["search", M, "--devices", "0-2"], "--devices"),
    (["search", M, "--devices", "5-3"], "--devices"),
    (["search", M, "--devices", "3", "--mesh", "2x2"], "--mesh"),
    (["search", M, "--cluster", "tpu-v9"], "tpu-v9"),
    (["search", M, "--axes", "split,pipeline"], "--axes"),
    (["search", M, "--axes", ","], "--axes"),
    (["search", M, "--micro-batches", "0,2"], "--micro-batches"),
    (["search", M, "--micro-batches", "two"], "--micro-batches"),
    (["search", M, "--cluster", "{bad_json}"], "bad.json"),
    (["search", M, "--memory-budget", "10"], "give a unit"),
    (["search", M, "--memory-budget", "lots"], "--memory-budget"),
    # a negative size reaches the option's own check, not argparse's "expected one argument"
    (["search", M, "--memory-budget", "-5GiB"], "give a size like"),
    (["report", M, "--memory-budget", "-5GiB", "-o", f"{OUT}/r"], "give a size like"),
    (["search", M, "--devices", "1,2", "--memory-budget", "1KiB"], "memory budget"),
    (["search", M, "--epsilon", "2"], "--epsilon"),
    (["search", M, "--jobs", "0"], "--jobs"),
    (["search", M, "--momentum", "2"], "--momentum"),
    (["search", M, "--plot", "/proc/f.png"], "--plot"),
    (["search", M, "--plot", "{a_dir}"], "is a directory"),
    (["search", M, "--dump-costs", f"{OUT}/nodir/c.json"], "--dump-costs"),
    (["search", M, "--loss", "hinge"], "--loss"),
    (["search", "{outdir}"], "directory"),
    # compile
    (["compile", M, "--devices", "2", "--plan", "nonsense", "-o", f"{OUT}/c"], "nonsense"),
    (["compile", M, "--devices", "0", "-o", f"{OUT}/c"], "--devices"),
    (["compile", M, "--devices", "two", "-o", f"{OUT}/c"], "--devices"),
    (["compile", M, "--devices", "1-4", "--pick", "fastest", "-o", f"{OUT}/c"], "one device count"),
    (["compile", M, "--devices", "3", "--mesh", "2x2", "-o", f"{OUT}/c"], "--mesh"),
    (["compile", M, "--devices", "4", "--mesh", "2xq", "-o", f"{OUT}/c"], "--mesh"),
    (["compile", M, "--devices", "2", "--pick", "fastest-under:10", "-o", f"{OUT}/c"], "unit"),
    (["compile", M, "--devices", "2", "--pick", "slowest", "-o", f"{OUT}/c"], "slowest"),
    (["compile", M, "--devices", "2", "--pick", "999", "-o", f"{OUT}/c"], "999"),
    # a picked point carries its stages and schedule; a schedule needs stages
    ([*PICKED, "--stages", "2", "-o", f"{OUT}/c"], "--stages 2 applies to --plan"),
    ([*PICKED, "--schedule", "gpipe", "-o", f"{OUT}/c"], "--schedule gpipe applies to --plan"),
    (["compile", M, "--devices", "2", "--schedule", "gpipe", "-o", f"{OUT}/c"], "no pipeline"),
    # stages without micro-batches, on every built-in plan (fsdp's recompute priced first)
    *[
        (
            ["compile", M, "--devices", "4", "--plan", p, "--stages", "2", "-o", f"{OUT}/c"],
            "--micro-batches 2 or more",
        )
        for p in ("data-parallel", "megatron", "fsdp")
    ],  # fmt: skip
    (["compile", M, "--devices", "2", "--pick", "fastest-under:1KiB", "-o", f"{OUT}/c"], "memory"),
    (
        ["compile", M, "--devices", "2", "--pick", "fewest-devices-under:1KiB", "-o", f"{OUT}/c"],
        "fits",
    ),  # fmt: skip
    (["compile", M, "--devices", "2", "--plan", "{missing}.json", "-o", f"{OUT}/c"], "no-such"),
    (["compile", M, "--devices", "2", "--plan", "{bad_json}", "-o", f"{OUT}/c"], "bad.json"),
    (["compile", M, "--devices", "4", "--plan", P, "-o", f"{OUT}/c"], "--devices 2"),
    (["compile", M, "--devices", "2", "-o", "/proc/c"], "/proc"),
    (["compile", M, "--devices", "2", "-o", "{a_file}"], "not a directory"),
    (["compile", M, "--devices", "2", "-o", "{foreign}"], "not a tensoropt output directory"),
    (
        [
            "compile",
            M,
            "--devices",
            "2",
            "--plan",
            "megatron",
            "--pick",
            "fastest",
            "-o",
            f"{OUT}/c",
        ],
        "not allowed with",
    ),  # fmt: skip
    (["compile", M, "--devices", "2", "--cluster", "nope", "-o", f"{OUT}/c"], "nope"),
    (["compile", M, "--devices", "2"], "-o"),
    (["compile", M, "--devices", "2", "-o", ""], "give a directory name"),
    (["compile", M, "--devices", "2", "--plan", "{a_dir}/", "-o", f"{OUT}/c"], "plan"),
    # run
    (["run", "{missing}"], "does not exist"),
    (["run", P], "not a directory"),
    (["run", O, "--steps", "0"], "--steps"),
    (["run", O, "--tolerance", "0"], "--tolerance"),
    (["run", O, "--backend", "gpu"], "--backend"),
    (["run", O, "--resume"], "--checkpoint"),
    (["run", O, "--checkpoint", f"{OUT}/ck", "--checkpoint-every", "0"], "--checkpoint-every"),
    (["run", O, "--steps", "2", "--profile", "--profile-warmup", "2"], "warm-up"),
    (["run", O, "--hostfile", "{a_file}"], "--hostfile"),
    (["run", O, "--data", "{wrong_npz}"], "wrong.npz"),
    (["run", O, "--save-params", "/proc/p.npz"], "--save-params"),
    (["run", O, "--arena", "huge"], "--arena"),
    (["run", O, "--threads", "0"], "--threads"),
    (["run", O, "--stall-timeout", "0"], "--stall-timeout"),
    (["run", O, "--profile", "--profile-warmup", "-1"], "--profile-warmup"),
    (["run", O, "--checkpoint", "{a_file}", "--steps", "1"], "is a file"),
    (["run", O, "--resume", "--checkpoint", "{ckpt}", "--steps", "2"], "step 3"),
    # inspect
    (["inspect", "{missing}"], "no-such-thing"),
    (["inspect", P], "JSON file"),
    (["inspect", "{garbage}"], "not a readable ONNX model"),
    (["inspect", "{foreign}"], "manifest"),
    (["inspect", "{outdir}", "--bogus"], "unrecognized arguments"),
    # report
    (["report", M, "-o", "/proc/r"], "/proc"),
    (["report", M, "--devices", "1,2", "--detail-devices", "4", "-o", f"{OUT}/r"], "4"),
    (["report", M, "-o", "{a_file}"], "not a directory"),
    (["report", M, "--devices", "1..3", "-o", f"{OUT}/r"], "1-3"),
    (["report", M, "--memory-budget", "8", "-o", f"{OUT}/r"], "give a unit"),
    # validate
    (["validate", M], "--cluster"),
    (["validate", M, "--cluster", "h100", "--points", "0"], "--points"),
    (["validate", M, "--cluster", "h100", "--rounds", "0"], "--rounds"),
    (["validate", M, "--cluster", "h100", "--steps", "2", "--warmup", "2"], "--warmup"),
    (["validate", M, "--cluster", "h100", "--plot", "/proc/v.png"], "--plot"),
    (["validate", M, "--cluster", "h100", "--devices", "1..3"], "1-3"),
    # calibrate
    (["calibrate", "-o", "/proc/c.json"], "/proc"),
    (["calibrate", "-o", f"{OUT}/c.json", "--repeats", "0"], "--repeats"),
    (["calibrate", "-o", f"{OUT}/c.json", "--ranks", "0"], "--ranks"),
    (["calibrate", "-o", f"{OUT}/c.json", "--against", "{missing}"], "no-such-thing"),
    (["calibrate", "-o", f"{OUT}/c.json", "--backend", "nccl"], "--backend"),
    # demo
    (["demo", "--backend", "gpu"], "--backend"),
]


def _fill(arg: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        arg = arg.replace("{" + key + "}", value)
    return arg


@pytest.mark.parametrize(
    ("argv", "fragment"), CASES, ids=[" ".join(argv)[:60] for argv, _ in CASES]
)
def test_bad_input_is_one_line_and_exit_2(inputs, tmp_path, capsys, argv, fragment):
    out = tmp_path / "out"
    out.mkdir()
    args = [_fill(a, {**inputs, "out": str(out)}) for a in argv]
    before = sorted(Path(inputs["a_dir"]).rglob("*"))
    capsys.readouterr()
    code = main(args)
    captured = capsys.readouterr()
    command = args[0] if not args[0].startswith("-") and args[0] != "frobnicate" else None
    prefix = f"tensoropt {command}: error: " if command else "tensoropt: error: "
    lines = captured.err.strip().splitlines()
    assert code == 2, captured
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(prefix), lines[0]
    assert fragment in lines[0], (fragment, lines[0])
    assert "Traceback" not in captured.err
    assert captured.out == "", captured.out
    assert list(out.iterdir()) == [], "partial output"
    assert sorted(Path(inputs["a_dir"]).rglob("*")) == before, "wrote into the inputs"


def test_the_sweep_covers_every_command():
    from tensoropt.cli import _COMMANDS

    swept = {argv[0] for argv, _ in CASES}
    assert set(_COMMANDS) <= swept, set(_COMMANDS) - swept
    assert len(CASES) >= 60


def test_the_inputs_are_what_the_cases_assume(inputs):
    plan = json.loads(Path(inputs["plan"]).read_text())
    assert plan["mesh"]["shape"] == [2]  # the "--devices 4 --plan P" case
    assert any(Path(inputs["ckpt"]).glob("rank_0.step_3*"))  # the resume case
