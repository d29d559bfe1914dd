"""``tensoropt inspect OUTDIR`` and ``inspect device_<k>.onnx`` (text and --json),
checked against hand computation for a Megatron MLP block; devices alike print once."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest

from tests.cli import models
from tests.cli.cli_run import assert_bad_input, cli

F32 = 4
B, D, H = models.B, models.D, models.H


@pytest.fixture(scope="module")
def gpt_tiny(tmp_path_factory) -> Path:
    from tensoropt.models import build_model, save_model

    path = tmp_path_factory.mktemp("gpt") / "gpt.onnx"
    save_model(build_model("gpt", "tiny"), str(path))
    return path


def _compile(tmp_path: Path, capsys, tp: int) -> Path:
    model = tmp_path / "block.onnx"
    onnx.save(models.mlp_block(), str(model))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(models.megatron_block_plan(tp)))
    out = tmp_path / "out"
    outcome = cli(
        capsys, "compile", model, "--devices", tp, "--plan", plan, "--loss", "mse", "-o", out
    )
    assert outcome.code == 0, outcome.err
    return out


def _hand(tp: int) -> dict:
    """What the canonical Megatron block must show on each rank of a tp mesh."""
    shards = {"W0": [D, D], "W1": [D, H // tp], "b1": [H // tp], "W2": [H // tp, D], "b2": [D]}
    elements = sum(int(np.prod(s)) for s in shards.values())
    # two AllReduces of a [B, D] float32 tensor: the block output, and the gradient of
    # the block input where it enters W0's unit (as Megatron-LM reduces it)
    ring = 2 * (tp - 1) / tp
    sent = 2 * ring * B * D * F32
    return {
        "shards": shards,
        "state_bytes": 2 * elements * F32,  # parameter + SGD momentum
        "sent": sent,
        "group": list(range(tp)),
    }


@pytest.mark.parametrize("tp", [2, 4])
def test_inspect_json_matches_hand_computation(tmp_path, capsys, tp):
    out = _compile(tmp_path, capsys, tp)
    outcome = cli(capsys, "inspect", out, "--json")
    assert outcome.code == 0, outcome.err
    data = json.loads(outcome.out)
    assert data["schema"] == "tensoropt.inspect/1"
    assert [d["file"] for d in data["devices"]] == [f"device_{k}.onnx" for k in range(tp)]
    want = _hand(tp)
    for entry in data["devices"]:
        graph = onnx.load(str(out / entry["file"])).graph
        assert entry["ops"] == len(graph.node) == sum(entry["op_types"].values())
        assert entry["op_types"]["AllReduce"] == 2
        assert entry["collectives"] == [
            {"kind": "AllReduce", "group": want["group"], "count": 2, "bytes_sent": want["sent"]}
        ]
        assert entry["bytes_sent_per_step"] == want["sent"]
        assert entry["param_shapes"] == want["shards"]
        assert entry["param_and_state_bytes"] == want["state_bytes"]
        resident = want["state_bytes"] + 2 * B * D * F32  # + x and the MSE labels
        assert resident <= entry["liveness_peak_bytes"] <= resident + 64 * B * H * F32


def test_inspect_reports_the_estimate_compile_reported(tmp_path, capsys):
    model = tmp_path / "block.onnx"
    onnx.save(models.mlp_block(), str(model))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(models.megatron_block_plan(2)))
    out = tmp_path / "out"
    compiled = cli(
        capsys, "compile", model, "--devices", 2, "--plan", plan, "--loss", "mse", "-o", out,
        "--json",
    )  # fmt: skip
    assert compiled.code == 0, compiled.err
    estimate = json.loads(compiled.out)["estimate"]
    assert estimate["collectives_per_device"] == 2 and estimate["memory_bytes"] > 0
    inspected = json.loads(cli(capsys, "inspect", out, "--json").out)
    assert inspected["estimate"] == estimate
    assert inspected["mesh"]["shape"] == [2]
    assert inspected["plan_source"] is not None
    text = cli(capsys, "inspect", out).out
    assert f"{estimate['time_s'] * 1e3:.3f} ms" in text and "liveness peak" in text


def test_inspect_text_shows_the_same_numbers(tmp_path, capsys):
    out = _compile(tmp_path, capsys, 2)
    outcome = cli(capsys, "inspect", out)
    assert outcome.code == 0, outcome.err
    lines = outcome.out.splitlines()
    want = _hand(2)
    # the two ranks hold, send and run the same: one section names both
    heads = [line for line in lines if line.startswith("device_")]
    assert len(heads) == 1
    m = re.match(
        r"device_0\.onnx, device_1\.onnx \(2 devices alike\): (\d+) ops, sends (\d+) B per "
        r"step, params\+state ([\d.]+) KiB",
        heads[0],
    )
    assert m, heads[0]
    assert int(m.group(2)) == want["sent"] == 512
    assert float(m.group(3)) == round(want["state_bytes"] / 1024, 1)
    rows = [line.split() for line in lines if line.strip().startswith("AllReduce")]
    assert rows == [["AllReduce", "0,1", "2", "512", "B"]]
    shards = [line for line in lines if "parameter shards:" in line]
    assert shards == ["  parameter shards: W0 8x8, W1 8x8, b1 8, W2 8x8, b2 8"]


def test_inspect_one_device_file_equals_its_outdir_entry(tmp_path, capsys):
    out = _compile(tmp_path, capsys, 2)
    whole = json.loads(cli(capsys, "inspect", out, "--json").out)["devices"][1]
    single = json.loads(cli(capsys, "inspect", out / "device_1.onnx", "--json").out)["devices"]
    assert single == [whole]
    text = cli(capsys, "inspect", out / "device_1.onnx").out
    assert text.startswith("device_1.onnx: ") and "AllReduce" in text


def test_inspect_data_parallel_counts_and_traffic(tmp_path, capsys):
    model = tmp_path / "block.onnx"
    onnx.save(models.mlp_block(), str(model))
    out = tmp_path / "dp"
    assert cli(capsys, "compile", model, "--devices", 4, "--loss", "mse", "-o", out).code == 0
    data = json.loads(cli(capsys, "inspect", out, "--json").out)
    params = D * D + D * H + H + H * D + D
    for entry in data["devices"]:
        # one AllReduce per parameter gradient (5) plus the loss, over all 4 ranks
        [stat] = entry["collectives"]
        assert (stat["kind"], stat["group"], stat["count"]) == ("AllReduce", [0, 1, 2, 3], 6)
        assert stat["bytes_sent"] == 2 * 3 / 4 * (params + 1) * F32
        assert entry["param_and_state_bytes"] == 2 * params * F32
    # four devices alike print once; the JSON keeps one entry per device
    text = cli(capsys, "inspect", out).out
    heads = [line for line in text.splitlines() if line.startswith("device_")]
    assert len(heads) == 1 and heads[0].startswith("device_0.onnx ... device_3.onnx (4 devices")
    assert len(data["devices"]) == 4


def test_inspect_keeps_devices_apart_that_differ(tmp_path, capsys, gpt_tiny):
    """On a dp x tp mesh each device's collectives run in other groups: one section each,
    and the recomputed blocks, the same on every device, are said once above them."""
    out = tmp_path / "m22"
    compiled = cli(capsys, "compile", gpt_tiny, "--devices", 4, "--plan", "megatron",
                   "--mesh", "2x2", "--recompute", "all", "-o", out)  # fmt: skip
    assert compiled.code == 0, compiled.err
    lines = cli(capsys, "inspect", out).out.splitlines()
    heads = [line for line in lines if line.startswith("device_")]
    assert [h.split(":")[0] for h in heads] == [f"device_{k}.onnx" for k in range(4)]
    every = lines.index("every device:")
    assert every < lines.index(heads[0])
    blocks = [line for line in lines if line.startswith("  recompute ")]
    assert [b.split(":")[0] for b in blocks] == [
        f"  recompute block_{k}" for k in range(len(blocks))
    ]  # once, in block order
    assert all(lines.index(b) < lines.index(heads[0]) for b in blocks)
    # a block's first 8 nodes by name, and how many more (the JSON names every one)
    listed = json.loads(cli(capsys, "inspect", out, "--json").out)["devices"][0]["recompute"]
    for line in blocks:
        block, rest = line.strip()[len("recompute ") :].split(": reruns ", 1)
        nodes = listed[block]
        names = rest.split(": ", 1)[1]
        more = f" (+{len(nodes) - 8} more; --json lists them all)" if len(nodes) > 8 else ""
        assert names == ", ".join(nodes[:8]) + more
    assert any(len(nodes) > 8 for nodes in listed.values())
    # one device file: its blocks below its figures
    alone = cli(capsys, "inspect", out / "device_2.onnx").out.splitlines()
    assert alone[0].startswith("device_2.onnx: ")
    assert [line for line in alone if line.startswith("  recompute ")] == blocks


def test_inspect_prints_a_pipeline_stage_once(tmp_path, capsys, gpt_tiny):
    """Two stages of two devices: each device sends to its own position in the other
    stage, so the rows name the stage and the devices of a stage print as one; the JSON
    keeps the peer's rank."""
    out = tmp_path / "pp"
    compiled = cli(capsys, "compile", gpt_tiny, "--devices", 4, "--stages", 2,
                   "--micro-batches", 2, "-o", out)  # fmt: skip
    assert compiled.code == 0, compiled.err
    lines = cli(capsys, "inspect", out).out.splitlines()
    heads = [line.split(":")[0] for line in lines if line.startswith("device_")]
    assert heads == ["device_0.onnx, device_1.onnx (2 devices alike)",
                     "device_2.onnx, device_3.onnx (2 devices alike)"]  # fmt: skip
    sends = [line.split()[:3] for line in lines if line.strip().startswith("Send")]
    assert sends == [["Send", "stage", "1"], ["Send", "stage", "0"]]
    data = json.loads(cli(capsys, "inspect", out, "--json").out)["devices"]
    peers = [[c["group"] for c in d["collectives"] if c["kind"] == "Send"] for d in data]
    assert peers == [[[2]], [[3]], [[0]], [[1]]]


def test_inspect_counts_the_blocks_past_the_first_eight():
    """A deep model recomputes a block per layer: the first 8 get a line each, in block
    order (block_2 before block_10), and one line counts the rest and their nodes."""
    from tensoropt.cli.cmd_inspect import SHOWN_BLOCKS, _recompute_lines

    rc = {f"block_{b}": [f"h{b}/n{j}" for j in range(1 + b % 3)] for b in range(20)}
    lines = _recompute_lines(rc)
    assert len(lines) == SHOWN_BLOCKS + 1 == 9
    assert [line.split(":")[0] for line in lines[:8]] == [f"recompute block_{b}" for b in range(8)]
    assert lines[2] == "recompute block_2: reruns 3 nodes: h2/n0, h2/n1, h2/n2"
    rest = sum(1 + b % 3 for b in range(8, 20))
    assert lines[8] == (
        f"recompute block_8 ... block_19: 12 more blocks, rerunning {rest} nodes "
        "(--json lists them all)"
    )
    assert _recompute_lines({k: rc[k] for k in list(rc)[:8]})[-1].startswith(
        "recompute block_7: "
    )  # eight blocks: no count line


@pytest.mark.parametrize(
    ("make", "fragments"),
    [
        (lambda p: p.write_text("not onnx"), ["x.onnx", "not a readable ONNX model"]),
        (
            lambda p: onnx.save(models.relu_only_model(), str(p)),
            ["x.onnx", "not a tensoropt training step"],
        ),
        (lambda p: p.mkdir(), ["x.onnx", "no manifest.json"]),
    ],
    ids=["not-onnx", "not-a-step", "empty-dir"],
)
def test_inspect_bad_targets(tmp_path, capsys, make, fragments):
    target = tmp_path / "x.onnx"
    make(target)
    assert_bad_input(cli(capsys, "inspect", target), "inspect", *fragments)


def test_inspect_outdir_with_missing_or_corrupt_device_file(tmp_path, capsys):
    out = _compile(tmp_path, capsys, 2)
    (out / "device_1.onnx").write_bytes(b"\x08garbage")
    assert_bad_input(cli(capsys, "inspect", out), "inspect", "device_1.onnx")
    (out / "device_1.onnx").unlink()
    assert_bad_input(cli(capsys, "inspect", out), "inspect", "device_1.onnx", "missing")
