"""Golden test of ``tensoropt demo``: the plan it compiles partitions work (collectives on
every device), ``--verify`` compares two different computations (a non-zero error within
tolerance), the frontier says partitioning pays, and the plot's reference markers lie on
the search JSON's figures."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest

from tests.cli.cli_run import cli, cli_process

pytest.importorskip("matplotlib")

_MEMORY_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """``demo --backend local --json`` run once, with every figure it saves recorded."""
    from matplotlib.figure import Figure

    from tensoropt.cli import main

    root = tmp_path_factory.mktemp("demo") / "demo"
    figures = []
    save = Figure.savefig

    def record(fig, *args, **kwargs):
        figures.append(fig)
        return save(fig, *args, **kwargs)

    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout):
        patch.setattr(Figure, "savefig", record)
        code = main(["demo", "--dir", str(root), "--backend", "local", "--json"])
    assert code == 0
    doc = json.loads(stdout.getvalue())  # stdout is the document alone
    search = json.loads((root / "search.json").read_text())
    return root, doc, search, figures


@pytest.mark.slow
def test_demo_compiles_a_plan_with_collectives_on_every_device(demo, capsys):
    root, doc, _, _ = demo
    assert doc["schema"] == "tensoropt.demo/1"
    compiled = doc["compile"]
    assert compiled["world_size"] == doc["devices"] == 2
    assert compiled["replicates_all_work"] is False
    assert compiled["collectives_per_device"] >= 1
    assert compiled["estimate"]["collectives_per_device"] >= 1
    inspected = json.loads(cli(capsys, "inspect", root / "compiled", "--json").out)
    for device in inspected["devices"]:  # counted in the written graphs themselves
        assert sum(c["count"] for c in device["collectives"]) >= 1, device["file"]


@pytest.mark.slow
def test_demo_verify_error_is_nonzero_and_within_tolerance(demo):
    _, doc, _, _ = demo
    verify = doc["run"]["verify"]
    assert verify["ok"] is True
    worst = max(verify["max_rel_error_loss"], verify["max_rel_error_params"])
    assert 0 < worst <= verify["tolerance"]
    assert verify["max_rel_error_params"] > 0  # the ranks' parameters are not copies


@pytest.mark.slow
def test_demo_frontier_says_partitioning_pays(demo):
    _, doc, search, _ = demo
    one, two = search["per_device"]["1"][0], search["per_device"]["2"][0]
    assert two["time_s"] < one["time_s"] and not two["replicates_all_work"]
    assert doc["compile"]["estimate"]["time_s"] == pytest.approx(two["time_s"], rel=1e-12)
    sentence = doc["frontier"]
    assert sentence.startswith("Partitioning pays") and sentence.count(". ") == 0
    assert f"{one['time_s'] * 1e3:.1f} ms" in sentence
    assert f"{two['time_s'] * 1e3:.1f} ms" in sentence


def test_frontier_sentence_says_when_no_plan_beats_one_device(zoo_file, capsys):
    """The tiny GPT on h100 is latency-bound: the sentence says so, in the words every
    place that prints such a plan uses."""
    from tensoropt.cli.cmd_demo import frontier_sentence

    out = cli(capsys, "search", zoo_file("gpt"), "--devices", "1,2", "--json")
    assert out.code == 0, out.err
    search = json.loads(out.out)
    assert search["per_device"]["2"][0]["replicates_all_work"] is True
    assert search["per_device"]["2"][0]["summary"] == "replicated (no faster than 1 device)"
    sentence = frontier_sentence(search, 2)
    assert sentence.startswith("No 2-device plan is faster than 1 device")
    assert "no faster than 1 device" in sentence and "pays" not in sentence
    assert "data-parallel" not in sentence


def _unit(label: str, units: dict[str, float]) -> float:
    match = re.search(r"\(([^()]+)\)\s*$", label)
    assert match and match.group(1) in units, label
    return units[match.group(1)]


def reference_markers(fig) -> list[tuple[str | None, float, float]]:
    """(label, time_s, memory_bytes) of every single-point scatter (the reference plans'
    markers; staircases are lines, legend entries have no points), read back from the
    artists in the axis' own units."""
    (ax,) = fig.axes
    x_unit = _unit(ax.get_xlabel(), _TIME_UNITS)
    y_unit = _unit(ax.get_ylabel(), _MEMORY_UNITS)
    found = []
    for artist in ax.collections:
        offsets = artist.get_offsets()
        if len(offsets) != 1:
            continue
        x, y = (float(v) for v in offsets[0])
        found.append((artist.get_label(), x * x_unit, y * y_unit))
    return found


@pytest.mark.slow
def test_demo_plot_reference_markers_lie_on_their_json_values(demo):
    _, _, search, figures = demo
    assert len(figures) == 1  # the demo saves one figure: the search's frontier.png
    markers = reference_markers(figures[0])
    refs = search["references"]
    pairs = {(r["devices"], r["plan"]) for r in refs}
    assert len(markers) >= len(pairs)
    for label, time_s, memory in markers:
        named = re.fullmatch(r"_(\S+) at (\d+) devices?", label or "")
        candidates = [
            r for r in refs if not named or (r["plan"], r["devices"]) == (named[1], int(named[2]))
        ]
        assert any(
            time_s == pytest.approx(r["time_s"], rel=1e-9)
            and memory == pytest.approx(r["memory_bytes"], rel=1e-9, abs=0.5)
            for r in candidates
        ), (label, time_s, memory)


@pytest.mark.slow
@pytest.mark.mpi
def test_demo_runs_end_to_end_over_mpi(tmp_path):
    out = cli_process("demo", "--dir", tmp_path / "demo", timeout=300)
    assert out.code == 0, out.err
    assert "verify: ok" in out.out and "Partitioning pays" in out.out
    assert "0 collectives per device" not in out.out
    for name in ("gpt.onnx", "cluster.json", "frontier.png", "search.json"):
        assert (tmp_path / "demo" / name).exists(), name
    assert (tmp_path / "demo" / "compiled" / "manifest.json").exists()


@pytest.mark.slow
def test_demo_trades_memory_with_the_axes_and_the_plan_trains_like_one_device(demo):
    """The second search (the memory axes at 2 devices) lowers the least memory below the
    split alone's; its least-memory point is what compile built (its estimate, and a plan
    that uses the axes), and three steps of it verify against one device."""
    root, doc, search, _ = demo
    every = json.loads((root / "memory-axes.json").read_text())
    assert every["axes_searched"] == ["split", "zero", "recompute", "micro"]
    least, before = every["per_device"]["2"][-1], search["per_device"]["2"][-1]
    assert least["memory_bytes"] < before["memory_bytes"]
    part = doc["memory_axes"]
    estimate = part["compile"]["estimate"]
    assert estimate["memory_bytes"] == least["memory_bytes"]
    assert estimate["time_s"] == pytest.approx(least["time_s"], rel=1e-12)
    plan = json.loads((root / "least-memory" / "plan.json").read_text())
    axes = least["axes"]
    assert plan["micro_batches"] == axes["micro_batches"]
    assert len(plan.get("recompute", [])) == axes["recompute_blocks"]
    zero = {u.get("zero", 0) for u in plan["units"].values()}
    assert (max(zero) == axes["zero"]) and (axes["zero"] or axes["micro_batches"] > 1)
    assert part["run"]["verify"]["ok"] is True
    sentence = part["sentence"]
    assert sentence.startswith("With the memory axes, 2 devices need as little as")
    assert f"{least['memory_bytes'] / 2**20:.1f} MiB" in sentence
    assert f"{before['memory_bytes'] / 2**20:.1f} MiB with the split alone" in sentence
    uses = sentence.split(" per device (", 1)[1].split(";", 1)[0]
    assert uses and least["summary"].endswith(f", {uses}")  # as the search tables say it
