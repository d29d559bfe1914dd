"""`tensoropt report` as a user runs it: sections, figures, links, atomicity, bad input."""

from __future__ import annotations

import re

import pytest

from tensoropt.report import plots
from tests.cli.cli_run import assert_bad_input, cli

pytest.importorskip("matplotlib")

PNG = b"\x89PNG\r\n\x1a\n"
SECTIONS = (
    "# Parallelization trade-offs: gpt (tiny preset) on h100",
    "## 1. The frontier per device count",
    "## 2. The fastest plan for each memory capacity",
    "## 3. The fewest devices for each step-time target",
    "## 4. How the strategies change along the frontier",
    "## 5. Reference plans against the frontier",
    "## 6. What each memory axis buys",
)


def _leftovers(parent):
    return [p.name for p in parent.iterdir() if p.name.startswith(".tensoropt-report-")]


def test_report_has_every_section_and_its_figures(gpt_file, tmp_path, capsys):
    out_dir = tmp_path / "report"
    axes = ("--axes", "split,zero,recompute,micro", "--micro-batches", "1,2")
    out = cli(capsys, "report", gpt_file, "--devices", "1,2,4", *axes, "-o", out_dir)
    assert out.code == 0, out.err
    text = (out_dir / "report.md").read_text()
    for heading in SECTIONS:
        assert heading in text, heading
    for fragment in ("**Guarantee**: exact", "**Time taken**", "1, 2, 4", "### 4 devices"):
        assert fragment in text, fragment
    assert "- **Axes**: searched split,zero,recompute,micro; not searched: stages (" in text
    assert "**Estimates**" not in text  # a built-in profile: nothing was measured
    assert "989 TFLOP/s peak" in text
    for capacity in (16, 24, 32, 40, 48, 80, 141):
        assert f"| {capacity} GiB |" in text, capacity
    assert "data parallel" in text and "Megatron" in text
    assert "FSDP (ZeRO-3 + recompute)" in text and "Megatron + recompute" in text
    # section 1 names the marker of every reference plan the figure draws
    first = text[text.index("## 1.") : text.index("![frontier")]
    for key in ("Open squares: data-parallel", "open triangles: Megatron",
                "open diamonds: FSDP", "open down triangles: Megatron + recompute"):  # fmt: skip
        assert key in first, key
    assert "pipeline stages" not in first  # no megatron+pp: stages were not searched
    axes = text[text.index("## 6. What each memory axis buys") :]
    assert "| devices | split | + ZeRO | + recompute | + micro-batches |" in axes
    # the stages were not searched: a dash in every row, not the level before again
    rows = [line for line in axes.splitlines() if line.startswith(("| 1 |", "| 2 |", "| 4 |"))]
    assert len(rows) == 3 and all(row.endswith("| - |") for row in rows), rows
    assert "The memory axes cut the least memory per device by up to" in axes
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    expected = {"frontier.png", "capacity.png", "fewest-devices.png", "strategies-4.png"}
    assert set(links) == expected
    for name in links:
        assert (out_dir / name).read_bytes()[:8] == PNG, name
    assert {p.name for p in out_dir.iterdir()} == expected | {"report.md"}
    assert _leftovers(tmp_path) == []


def test_report_replaces_an_old_report(gpt_file, tmp_path, capsys):
    out_dir = tmp_path / "report"
    first = cli(capsys, "report", gpt_file, "--devices", "1,2", "-o", out_dir)
    assert first.code == 0, first.err
    assert (out_dir / "strategies-2.png").exists()
    again = cli(capsys, "report", gpt_file, "--devices", "1", "-o", out_dir)
    assert again.code == 0, again.err
    assert not (out_dir / "strategies-2.png").exists()  # replaced, not merged
    assert "devices 1;" in (out_dir / "report.md").read_text()


def test_failure_while_plotting_leaves_no_report(gpt_file, tmp_path, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("plotting failed")

    monkeypatch.setattr(plots, "heatmap", broken)
    out_dir = tmp_path / "report"
    with pytest.raises(RuntimeError, match="plotting failed"):
        cli(capsys, "report", gpt_file, "--devices", "1,2", "-o", out_dir)
    assert not out_dir.exists()
    assert _leftovers(tmp_path) == []


def test_failure_keeps_the_previous_report(gpt_file, tmp_path, capsys, monkeypatch):
    out_dir = tmp_path / "report"
    assert cli(capsys, "report", gpt_file, "--devices", "1,2", "-o", out_dir).code == 0
    before = {p.name: p.read_bytes() for p in out_dir.iterdir()}

    def broken(*args, **kwargs):
        raise RuntimeError("plotting failed")

    monkeypatch.setattr(plots, "capacity", broken)
    with pytest.raises(RuntimeError):
        cli(capsys, "report", gpt_file, "--devices", "1,2,4", "-o", out_dir)
    assert {p.name: p.read_bytes() for p in out_dir.iterdir()} == before
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--cluster", "tpu-v9"], ["unknown cluster profile", "h100"]),
        (["--memory-budget", "1KiB"], ["smallest memory", "1 device:"]),
        (["--detail-devices", "8"], ["--detail-devices 8", "1,2"]),
        (["--epsilon", "3"], ["--epsilon"]),
    ],
)
def test_bad_input_exits_2_with_one_line(gpt_file, tmp_path, capsys, argv, fragments):
    out_dir = tmp_path / "report"
    out = cli(capsys, "report", gpt_file, "--devices", "1,2", "-o", out_dir, *argv)
    assert_bad_input(out, "report", *fragments)
    assert not out_dir.exists()
    assert _leftovers(tmp_path) == []


def test_refuses_to_replace_a_directory_that_is_not_a_report(gpt_file, tmp_path, capsys):
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    out = cli(capsys, "report", gpt_file, "--devices", "1", "-o", other)
    assert_bad_input(out, "report", "not a tensoropt report directory")
    assert (other / "notes.txt").read_text() == "keep me"
    assert _leftovers(tmp_path) == []


def test_the_axes_section_matches_the_search_restricted_to_each_level(gpt_file):
    """Section 6's least memory per level equals the least memory of a search with
    --axes restricted to that level's axes."""
    import argparse

    from tensoropt.cli.cmd_search import search_space
    from tensoropt.cli.common import search_graph
    from tensoropt.cost.cluster import builtin
    from tensoropt.report.analysis import axis_gains
    from tensoropt.search.driver import device_frontier, explore

    def least(axes):
        args = argparse.Namespace(
            model=str(gpt_file), input_shape=None, trainable=None, freeze=None,
            optimizer="sgd", momentum=0.9, lr=0.01, loss="auto", axes=axes,
            micro_batch_counts="1,2,4",
        )  # fmt: skip
        sg = search_graph(args)
        exp = explore(sg, [2], "auto", builtin("h100"), jobs=1, space=search_space(args, sg))
        return exp, device_frontier(exp, 2)[-1][1].memory_bytes

    full, _ = least("split,zero,recompute,micro")
    (row,) = axis_gains(full)
    levels = ("split", "split,zero", "split,zero,recompute", "split,zero,recompute,micro")
    for axes, point in zip(levels, row.least[: len(levels)], strict=True):
        assert point is not None
        assert point.memory_bytes == least(axes)[1], axes
    # pipeline stages were not searched: that level is empty (a dash), not the level
    # before it again, which would say that stages buy nothing
    assert row.least[len(levels)] is None
    assert row.least[len(levels) - 1].memory_bytes < row.least[0].memory_bytes
    # a search of the split and ZeRO alone fills those two levels only
    (row,) = axis_gains(least("split,zero")[0])
    assert row.least[0] is not None and row.least[1] is not None
    assert row.least[2:] == (None, None, None)


def test_fmt_flops_keeps_three_figures():
    from tensoropt.report.render import fmt_flops

    assert fmt_flops(9.25e10) == "92.5 GFLOP/s"  # a CPU core pair: not "0 TFLOP/s"
    assert fmt_flops(989e12) == "989 TFLOP/s"
    assert fmt_flops(2.5e15) == "2.5 PFLOP/s"
    assert fmt_flops(3e6) == "3 MFLOP/s"


def test_a_measured_profile_states_its_estimates(gpt_file, tmp_path, capsys):
    """A profile with a validate record and memory-link probes (the keys `calibrate` and
    `validate --record` write): the header says how far its estimates are off and which
    memory-link case they assume."""
    import json

    probe = {"alone_Bps": 2.0e10, "together_Bps": 1.0e10, "processes": 2}
    profile = tmp_path / "measured.json"
    profile.write_text(json.dumps({
        "base": "h100",
        "name": "measured",
        "peak_flops": 9.25e10,
        "calibration": {"memory_link": [{**probe, "ratio": 0.5, "shared": True}]},
        "accuracy": {"plans": [
            {"run": "r", "model": "m", "devices": 1, "time": 0.04, "memory": 0.1, "link": None},
            {"run": "r", "model": "m", "devices": 2, "time": -0.3, "memory": 0.1,
             "link": "shared"},
        ]},
    }))  # fmt: skip
    out_dir = tmp_path / "report"
    out = cli(capsys, "report", gpt_file, "--devices", "1,2", "--cluster", profile, "-o", out_dir)
    assert out.code == 0, out.err
    text = (out_dir / "report.md").read_text()
    assert "92.5 GFLOP/s peak" in text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("- **Estimates**: ")]
    assert "within +-4% on one device, +-30% on several (validated: median error of 2" in line
    assert "sharing one in 1 of 1 probes (0.50-0.50" in line
    assert "shared links -30% (1 plan)" in line
