"""Every command as a new user meets it (issue 15, items 1, 2, 3, 9 and 10): the
documented ``--pick`` policies, the frontier plot's markers and budget line, ordinary
mistakes, the ``--devices`` forms, the tables' wording and the help texts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensoropt.cli import build_parser, main
from tests.cli.cli_run import Outcome, assert_bad_input, cli
from tests.helpers.figures import legends_beside_their_axes, record_saved

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def gpt(tmp_path_factory) -> Path:
    from tensoropt.models import build_model, save_model

    path = tmp_path_factory.mktemp("gpt") / "gpt.onnx"
    save_model(build_model("gpt", "tiny"), str(path))
    return path


def _estimate(outdir: Path) -> dict:
    return json.loads((outdir / "manifest.json").read_text())["estimate"]


def _world(outdir: Path) -> int:
    return json.loads((outdir / "manifest.json").read_text())["world_size"]


def _explore(model: Path, *argv: str):
    """The search's exploration for ``search MODEL ARGV``, computed through the library."""
    from tensoropt.cli.cmd_search import explore_from_args
    from tensoropt.cli.common import parse_devices

    args = build_parser().parse_args(["search", str(model), *argv])
    return explore_from_args(args, parse_devices(args.devices))[2]


# -- item 1: every documented --pick policy through the CLI ----------------------------


@pytest.fixture(scope="module")
def least_memory(gpt, tmp_path_factory) -> dict[int, float]:
    """The least memory per device at 1 and 2 devices, from compiled min-memory picks."""
    out = {}
    for d in (1, 2):
        outdir = tmp_path_factory.mktemp("mm") / "o"
        assert main(["compile", str(gpt), "--devices", str(d), "--pick", "min-memory",
                     "-o", str(outdir)]) == 0  # fmt: skip
        out[d] = _estimate(outdir)["memory_bytes"]
    assert out[2] < out[1]
    return out


@pytest.mark.parametrize("devices", ["4", "1-4", "1,2,4", "1..4"])
def test_fewest_devices_under_picks_the_fewest_count_that_fits(
    gpt, least_memory, tmp_path, capsys, devices
):
    budget = int((least_memory[1] + least_memory[2]) / 2)  # 2 devices fit, 1 does not
    out = cli(capsys, "compile", gpt, "--devices", devices, "--pick",
              f"fewest-devices-under:{budget}B", "-o", tmp_path / "o")  # fmt: skip
    assert out.code == 0, out.err
    assert "at 2 devices" in out.err
    assert _world(tmp_path / "o") == 2
    assert _estimate(tmp_path / "o")["memory_bytes"] <= budget


@pytest.mark.parametrize("policy", ["fastest", "min-memory", "fastest-under:{budget}B", "1"])
def test_every_pick_policy_compiles_at_the_asked_count(gpt, least_memory, tmp_path, capsys, policy):
    budget = int(least_memory[2] * 1.2)
    policy = policy.format(budget=budget)
    out = cli(capsys, "compile", gpt, "--devices", "2", "--pick", policy, "-o", tmp_path / "o")
    assert out.code == 0, out.err
    assert f"picked {policy}: point" in out.err
    assert _world(tmp_path / "o") == 2
    memory = _estimate(tmp_path / "o")["memory_bytes"]
    if policy == "min-memory":
        assert memory == least_memory[2]
    if policy.startswith("fastest-under"):
        assert memory <= budget


def test_compile_help_says_what_devices_means_for_fewest_devices_under(capsys):
    assert main(["compile", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "fewest-devices-under:MEM" in text
    assert "candidate counts" in text
    assert "the powers of two below N, and N" in text


# -- item 2: the frontier plot -----------------------------------------------------------


@pytest.fixture
def drawn(monkeypatch) -> list:
    """The figures ``search --plot`` saves."""
    return record_saved(monkeypatch)


def _unit_scale(ax) -> float:
    unit = ax.get_ylabel().rsplit("(", 1)[1].rstrip(")")
    return {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def test_plot_markers_sit_on_the_reference_plans_in_the_axis_unit(gpt, tmp_path, capsys, drawn):
    from matplotlib.collections import PathCollection

    out = cli(capsys, "search", gpt, "--devices", "1,2", "--plot", tmp_path / "f.png")
    assert out.code == 0, out.err
    (fig,) = drawn
    ax = fig.axes[0]
    scale = _unit_scale(ax)
    assert scale < 2**30  # the tiny GPT's memory is drawn in KiB or MiB
    markers = [
        tuple(xy) for c in ax.collections if isinstance(c, PathCollection) for xy in c.get_offsets()
    ]
    exp = _explore(gpt, "--devices", "1,2")
    refs = {(t * 1e3, m / scale) for s in exp.searches for name, (t, m, _) in s.references.items()}
    assert markers, "no reference marker drawn"
    for x, y in markers:
        assert any(np.isclose(x, rx, rtol=1e-9) and np.isclose(y, ry, rtol=1e-9)
                   for rx, ry in refs), (x, y, refs)  # fmt: skip


def test_plot_keeps_single_point_counts_visible_and_says_1_device(gpt, tmp_path, capsys, drawn):
    out = cli(capsys, "search", gpt, "--devices", "1,2,4", "--plot", tmp_path / "f.png")
    assert out.code == 0, out.err
    ax = drawn[0].axes[0]
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert "1 device" in labels and "1 devices" not in labels
    lines = {line.get_label(): line for line in ax.get_lines()}
    single = [k for k, line in lines.items() if "device" in k and len(line.get_xdata()) == 1]
    longer = [k for k, line in lines.items() if "device" in k and len(line.get_xdata()) > 1]
    assert single and longer  # the tiny GPT has one plan at 1 device and many at 2 and 4
    for k in single:
        assert all(lines[k].get_zorder() > lines[o].get_zorder() for o in longer), k
        assert all(lines[k].get_markersize() > lines[o].get_markersize() for o in longer), k


def test_plot_marks_what_each_point_uses_of_the_memory_axes(gpt, tmp_path, capsys, drawn):
    """With the memory axes searched, every frontier point is drawn once, in its count's
    colour, with the marker of what its problem uses; the legend names those kinds and
    the staircases carry no markers of their own."""
    from tensoropt.report.plots import _USES_MARKERS, uses_of
    from tensoropt.search.driver import device_frontier

    argv = ("--devices", "1,2", "--axes", "split,zero,recompute,micro", "--micro-batches", "1,2")
    out = cli(capsys, "search", gpt, *argv, "--plot", tmp_path / "f.png")
    assert out.code == 0, out.err
    ax = drawn[0].axes[0]
    scale = _unit_scale(ax)
    staircases = {line.get_label(): line for line in ax.get_lines() if "device" in line.get_label()}
    assert set(staircases) == {"1 device", "2 devices"}
    assert all(line.get_marker() in (None, "None", "") for line in staircases.values())
    marked = {
        line.get_label(): line for line in ax.get_lines() if line.get_label().startswith("_uses ")
    }
    exp = _explore(gpt, *argv)
    kinds = set()
    for d in (1, 2):
        colour = staircases[f"{d} device" + ("s" if d > 1 else "")].get_color()
        for search, point in device_frontier(exp, d):
            uses = uses_of(search.variant)
            marker, name = _USES_MARKERS[uses]
            line = marked[f"_uses {name} of count {d}"]
            assert line.get_marker() == marker and line.get_color() == colour
            xy = np.column_stack([line.get_xdata(), line.get_ydata()])
            want = (point.time_s * 1e3, point.memory_bytes / scale)
            assert np.isclose(xy, want, rtol=1e-9).all(axis=1).any(), (name, want)
            kinds.add(uses)
    drawn_points = sum(len(line.get_xdata()) for line in marked.values())
    assert drawn_points == sum(len(device_frontier(exp, d)) for d in (1, 2))
    assert {(), ("zero",), ("micro",)} <= kinds  # the tiny GPT's frontier uses each
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    # the legend names exactly the kinds drawn
    assert {x for x in labels if x.startswith("uses ")} == {
        f"uses {_USES_MARKERS[k][1]}" for k in kinds
    }


def test_plot_legend_names_only_the_reference_plans_drawn(gpt, tmp_path, capsys, drawn):
    """A model without Megatron blocks (ResNet) gets no Megatron entries in the legend;
    the tiny GPT, which has them, does."""
    from tensoropt.models import build_model, save_model

    resnet = tmp_path / "resnet.onnx"
    save_model(build_model("resnet50", "tiny"), str(resnet))
    for model, megatron in ((resnet, False), (gpt, True)):
        drawn.clear()
        out = cli(capsys, "search", model, "--devices", "2", "--plot", tmp_path / "f.png")
        assert out.code == 0, out.err
        labels = [t.get_text() for t in drawn[0].axes[0].get_legend().get_texts()]
        assert "data-parallel" in labels
        assert ("Megatron" in labels) is megatron, labels


def test_legends_cover_no_plotted_area(gpt, tmp_path, capsys, drawn):
    """Every legend of ``search --plot`` and ``report`` sits beside its axes: inside, the
    fewest-devices legend covered the largest count's line along the top, and the
    frontier's covered staircases that reach the corners."""
    out = cli(capsys, "search", gpt, "--devices", "1,2,4", "--plot", tmp_path / "f.png")
    assert out.code == 0, out.err
    out = cli(capsys, "report", gpt, "--devices", "1,2,4", "-o", tmp_path / "report")
    assert out.code == 0, out.err
    legends = legends_beside_their_axes(drawn)
    assert legends >= 4  # the search's frontier and report's frontier, capacity, devices


def test_memory_budget_draws_a_line_marks_references_and_skips_empty_tables(
    gpt, tmp_path, capsys, drawn
):
    exp = _explore(gpt, "--devices", "1,2")
    least = {
        d: min(p.memory_bytes for s in exp.searches if s.mesh.size == d for p in s.result.points)
        for d in (1, 2)
    }
    budget = int((least[1] + least[2]) / 2)  # nothing fits at 1 device
    out = cli(capsys, "search", gpt, "--devices", "1,2", "--memory-budget", f"{budget}B",
              "--plot", tmp_path / "f.png")  # fmt: skip
    assert out.code == 0, out.err
    assert "1 device: no plan fits the memory budget" in out.out
    assert "pick" not in out.out.split("1 device:")[1].split("\n2 devices")[0]
    refs = [line for line in out.out.splitlines() if "data-parallel" in line and "mesh" in line]
    one = [line for line in refs if line.lstrip().startswith("1 device ")]
    assert one and all("over the memory budget" in line for line in one)
    ax = drawn[0].axes[0]
    (line,) = [line for line in ax.get_lines() if line.get_label() == "memory budget"]
    assert np.allclose(line.get_ydata(), budget / _unit_scale(ax))


def test_report_frontier_draws_the_memory_budget(gpt, tmp_path, capsys, drawn):
    exp = _explore(gpt, "--devices", "1,2")
    budget = int(max(p.memory_bytes for s in exp.searches for p in s.result.points))
    out = cli(capsys, "report", gpt, "--devices", "1,2", "--memory-budget", f"{budget}B",
              "-o", tmp_path / "r")  # fmt: skip
    assert out.code == 0, out.err
    frontier = next(f for f in drawn if f.axes[0].get_title().startswith("Frontier"))
    ax = frontier.axes[0]
    (line,) = [line for line in ax.get_lines() if line.get_label() == "memory budget"]
    assert np.allclose(line.get_ydata(), budget / _unit_scale(ax))


# -- item 3: ordinary mistakes -------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled(gpt, tmp_path_factory) -> Path:
    outdir = tmp_path_factory.mktemp("c") / "out"
    assert main(["compile", str(gpt), "--devices", "2", "--plan", "data-parallel",
                 "-o", str(outdir)]) == 0  # fmt: skip
    return outdir


def test_inspect_a_plan_json_says_what_to_give(compiled, capsys):
    out = cli(capsys, "inspect", compiled / "plan.json")
    assert_bad_input(out, "inspect", "plan.json", "JSON file", "device_<k>.onnx")


def test_a_json_file_as_model_is_not_onnx(compiled, capsys):
    out = cli(capsys, "search", compiled / "plan.json", "--devices", "1")
    assert_bad_input(out, "search", "plan.json", "not a readable ONNX model")


def test_unwritable_report_directory_is_one_line(gpt, capsys):
    out = cli(capsys, "report", gpt, "--devices", "1,2", "-o", "/proc/x")
    assert_bad_input(out, "report", "-o /proc/x", "choose another path")


def test_inspect_into_a_closed_pipe_is_quiet(compiled):
    """``tensoropt inspect OUTDIR | head -0``: the reader is gone before anything is
    written; no traceback, exit 141 (128 + SIGPIPE) like a shell tool."""
    read, write = os.pipe()
    os.close(read)
    proc = subprocess.run(
        [sys.executable, "-m", "tensoropt", "inspect", str(compiled)],
        stdout=write,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    os.close(write)
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr
    assert proc.returncode == 141, proc.stderr


def test_usage_errors_are_one_line_naming_the_command(gpt, capsys):
    out = cli(capsys, "search", gpt, "--devices")
    assert_bad_input(out, "search", "--devices", "--help")
    out = cli(capsys, "search", gpt, "--bogus")
    assert_bad_input(out, "search", "unrecognized arguments: --bogus")
    out = cli(capsys, "compile", gpt, "--devices", "2")
    assert_bad_input(out, "compile", "-o")


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        ("search", ["--memory-budget", "10"]),
        ("compile", ["--devices", "2", "--pick", "fastest-under:10", "-o", "never"]),
        ("compile", ["--devices", "4", "--pick", "fewest-devices-under:70", "-o", "never"]),
    ],
)
def test_sizes_without_a_unit_are_refused(gpt, capsys, command, argv):
    out = cli(capsys, command, gpt, *argv)
    assert_bad_input(out, command, "give a unit", "GiB")


def test_resume_with_nothing_left_to_run_says_so(compiled, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert cli(capsys, "run", compiled, "--steps", "3", "--checkpoint", ckpt).code == 0
    for steps in ("2", "3"):
        out = cli(capsys, "run", compiled, "--resume", "--checkpoint", ckpt, "--steps", steps)
        assert_bad_input(out, "run", "step 3", f"--steps {steps}", "above 3")
    again = cli(capsys, "run", compiled, "--resume", "--checkpoint", ckpt, "--steps", "4")
    assert again.code == 0, again.err
    assert again.out.strip().splitlines()[-1].split()[0] == "3"  # only step 3 ran


def test_exit_codes_are_documented_with_their_own_code_for_verification(capsys):
    from tensoropt.errors import ExitCode

    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert ExitCode.VERIFY_FAILED != ExitCode.INTERNAL
    for code in (0, 1, 2, int(ExitCode.VERIFY_FAILED)):
        assert f"\n  {code} " in text, code
    assert main(["run", "--help"]) == 0
    assert f"{int(ExitCode.VERIFY_FAILED)} verification failed" in capsys.readouterr().out


# -- item 9: --devices forms and the tables' indices ---------------------------------------


def test_devices_forms_follow_the_documented_rule(gpt, capsys):
    out = cli(capsys, "search", gpt, "--devices", "3..5")
    assert_bad_input(out, "search", "3..5", "powers of two", "3-5")
    out = cli(capsys, "search", gpt, "--devices", "1..8")
    assert out.code == 0, out.err
    counts = [line.split()[0] for line in out.out.splitlines() if " frontier point" in line]
    assert counts == ["1", "2", "4", "8"]
    assert main(["search", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "A-B every count" in text and "A..B the powers of two" in text


def _overall_rows(text: str) -> list[list[str]]:
    overall = text.split("overall frontier over")[1].split("\n  (n:")[0]
    return [line.split() for line in overall.splitlines()[2:]]


def test_tables_say_when_they_sample_and_label_their_indices(gpt, tmp_path, capsys):
    out = cli(capsys, "search", gpt, "--devices", "1,2", "--json-out", tmp_path / "s.json")
    assert out.code == 0, out.err
    two = out.out.split("\n2 devices: ")[1].split("\n\n")[0]
    total = int(two.split()[0])
    rows = [line for line in two.splitlines()[2:] if line.strip()[:1].isdigit()]
    assert total > len(rows) == 10
    assert "(10 shown, evenly spaced" in two
    header = two.splitlines()[1].split()
    assert header[0] == "pick"
    overall = out.out.split("overall frontier over")[1]
    assert overall.splitlines()[1].split()[:3] == ["n", "devices", "pick"]
    assert "not a --pick index" in overall
    # the pick column is the point's row at its device count, as the JSON says
    frontier = json.loads((tmp_path / "s.json").read_text())["frontier"]
    rows = _overall_rows(out.out)
    assert rows and "uses" not in overall.splitlines()[1]  # the split alone: no column
    for n, devices, pick, *_ in rows:
        point = frontier[int(n)]
        assert (point["devices"], point["row"]) == (int(devices), int(pick))


def test_the_overall_frontier_says_what_each_point_uses(gpt, tmp_path, capsys):
    out = cli(capsys, "search", gpt, "--devices", "2", "--axes", "split,zero,micro",
              "--json-out", tmp_path / "s.json")  # fmt: skip
    assert out.code == 0, out.err
    frontier = json.loads((tmp_path / "s.json").read_text())["frontier"]
    lines = out.out.split("overall frontier over")[1].splitlines()
    assert lines[1].split()[-1] == "uses"
    seen = set()
    for line in lines[2:]:
        if not line.strip()[:1].isdigit():
            break
        # n, devices, pick, mesh, time and its unit, memory and its unit, then the uses
        *head, uses = line.split(maxsplit=8)
        n = int(head[0])
        problem = frontier[n]["problem"]  # the variant's tag after the mesh: "2+zero-3"
        zero = next((p for p in problem.split("+") if p.startswith("zero-")), None)
        micro = next((p[6:] for p in problem.split("+") if p.startswith("micro-")), None)
        assert (zero in uses) if zero else "zero" not in uses, (problem, uses)
        assert (f"{micro} micro-batches" in uses) if micro else "micro" not in uses
        assert (uses == "split only") == (problem == "2"), (problem, uses)
        seen.add(uses)
    assert "split only" in seen and len(seen) > 1


def test_search_compile_and_inspect_print_one_estimate_alike(gpt, tmp_path, capsys):
    """The same plan's estimate reads the same in the search table, compile's summary and
    inspect's estimate line (compile printed "0.1 MiB" for a point the table showed as
    0.08 MiB, and a 43 GiB plan as "44236.8 MiB")."""
    from tensoropt.display import fmt_memory, fmt_step_time

    out = cli(capsys, "search", gpt, "--devices", "2", "--json-out", tmp_path / "s.json")
    assert out.code == 0, out.err
    two = out.out.split("\n2 devices: ")[1].split("\n\n")[0]
    row = next(line for line in two.splitlines()[2:] if line.split()[:1] == ["0"])
    cells = row.split()
    shown_time, shown_memory = " ".join(cells[2:4]), " ".join(cells[4:6])
    point = json.loads((tmp_path / "s.json").read_text())["per_device"]["2"][0]
    assert (shown_time, shown_memory) == (
        fmt_step_time(point["time_s"]), fmt_memory(point["memory_bytes"])
    )  # fmt: skip
    outdir = tmp_path / "out"
    compiled = cli(capsys, "compile", gpt, "--devices", 2, "--pick", 0, "-o", outdir)
    assert compiled.code == 0, compiled.err
    assert f"estimated step {shown_time}, {shown_memory} per device" in compiled.out
    inspected = cli(capsys, "inspect", outdir).out.splitlines()[0]
    assert inspected.startswith(f"estimate (h100): step {shown_time}, {shown_memory} per device")
    # the units as the sizes need them
    assert [fmt_memory(x) for x in (1, 500 * 2**10, 3 * 2**20, 43.2 * 2**30)] == [
        "1 B", "500.00 KiB", "3.00 MiB", "43.200 GiB"
    ]  # fmt: skip
    assert [fmt_step_time(x) for x in (0.0015, 2.5)] == ["1.500 ms", "2.500 s"]


def test_rows_that_fewer_devices_match_say_so(gpt, tmp_path, capsys):
    """A row is marked "no better than N devices" exactly when a point on N < d devices
    (the fewest such N) is at most as slow with no more memory: how many devices a plan
    needs; the JSON's ``no_better_than_devices`` says the same. The 1-device comparison
    of a plan that replicates all work is its own note in the text."""
    out = cli(capsys, "search", gpt, "--devices", "1..8", "--json-out", tmp_path / "s.json")
    assert out.code == 0, out.err
    per_device = json.loads((tmp_path / "s.json").read_text())["per_device"]
    marked = 0
    for d in (2, 4, 8):
        table = out.out.split(f"\n{d} devices: ")[1].split("\n\n")[0]
        for line in table.splitlines()[2:]:
            if not line.strip()[:1].isdigit():
                continue
            point = per_device[str(d)][int(line.split()[0])]
            fewer = [
                c for c in (1, 2, 4) if c < d and any(
                    q["time_s"] <= point["time_s"] and q["memory_bytes"] <= point["memory_bytes"]
                    for q in per_device[str(c)]
                )
            ]  # fmt: skip
            assert point["no_better_than_devices"] == (fewer[0] if fewer else None)
            if fewer and "(no faster than 1 device)" not in line:
                noun = "device" if fewer[0] == 1 else "devices"
                assert line.endswith(f"(no better than {fewer[0]} {noun})"), line
                marked += 1
            else:
                assert "no better than" not in line, line
    assert marked  # the tiny GPT has such rows at 8 devices
    assert "(no better than N devices: a plan on fewer devices" in out.out
    # compile --search says so of such a point, and not of the others
    rows = per_device["8"]
    k = next(i for i, r in enumerate(rows) if (r["no_better_than_devices"] or 1) > 1)
    fewer = rows[k]["no_better_than_devices"]
    for pick, said in ((k, True), (len(rows) - 1, rows[-1]["no_better_than_devices"])):
        compiled = cli(capsys, "compile", gpt, "--devices", 8, "--search", tmp_path / "s.json",
                       "--pick", pick, "-o", tmp_path / f"p{pick}")  # fmt: skip
        assert compiled.code == 0, compiled.err
        note = f"note: no better than {fewer} devices: a plan of "
        assert (note in compiled.err) == bool(said), compiled.err


# -- item 10: wording ------------------------------------------------------------------------


def test_one_frontier_point_is_singular(gpt, capsys):
    out = cli(capsys, "search", gpt, "--devices", "1")
    assert out.code == 0, out.err
    assert "1 device: 1 frontier point\n" in out.out


def test_parameter_counts_are_global_for_picked_and_hand_plans(gpt, tmp_path, capsys):
    picked = cli(capsys, "compile", gpt, "--devices", "2", "--pick", "min-memory",
                 "-o", tmp_path / "a")  # fmt: skip
    hand = cli(capsys, "compile", gpt, "--devices", "2", "--plan", "megatron",
               "-o", tmp_path / "b")  # fmt: skip
    assert picked.code == hand.code == 0, (picked.err, hand.err)

    def line(out: Outcome) -> str:
        return next(x for x in out.err.splitlines() if x.startswith("training "))

    assert line(picked) == line(hand)
    params = sum(int(np.prod(t.dims)) for t in onnx.load(str(gpt)).graph.initializer)
    assert f"({params:,} elements, whole model)" in line(picked)


def test_integer_initializers_are_not_called_frozen(tmp_path, capsys):
    """A shape constant is no parameter: the summary counts float initializers only."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 6)).astype(np.float32), "W")
    shape = numpy_helper.from_array(np.array([8, 3], np.int64), "shape")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["h"]),
            helper.make_node("Reshape", ["h", "shape"], ["y"]),
        ],
        "reshape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 3])],
        [w, shape],
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), str(path))
    out = cli(capsys, "train", path, "--steps", "1", "--loss", "mse")
    assert out.code == 0, out.err
    assert "training 1 parameters (24 elements, whole model)" in out.err
    assert "frozen" not in out.err and "not trained" not in out.err


def test_compile_without_plan_or_pick_says_which_plan(gpt, tmp_path, capsys):
    out = cli(capsys, "compile", gpt, "--devices", "2", "-o", tmp_path / "o")
    assert out.code == 0, out.err
    assert "no --plan or --pick given: compiled --plan data-parallel" in out.err


def test_run_of_a_missing_directory_names_the_directory(tmp_path, capsys):
    out = cli(capsys, "run", tmp_path / "nodir")
    line = assert_bad_input(out, "run", "nodir", "does not exist")
    assert "manifest" not in line


def _options_with_defaults():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, command in sub.choices.items():
        for action in command._actions:
            default = action.default
            if not action.option_strings or default is None or default is False:
                continue
            if default == "==SUPPRESS==":
                continue
            yield name, command, action


def test_every_option_with_a_default_names_it_in_help():
    missing = []
    for name, command, action in _options_with_defaults():
        text = command._get_formatter()._expand_help(action) if action.help else ""
        if "default" not in text:
            missing.append(f"{name} {action.option_strings[-1]}")
    assert not missing, missing


def test_run_help_explains_the_profile_spread_column(capsys):
    assert main(["run", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "spread:" in text and "median" in text.split("spread:")[1][:200]


def test_version(capsys):
    from tensoropt import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tensoropt {__version__}"


def test_help_builds_its_parsers_without_the_solver_or_onnx():
    # `tensoropt --help` answers in a fifth of a second: the parsers read constants of
    # the search package and the zoo's names, not the solver (numba and the compiled
    # kernels, 1.5 s to import) or onnx and the zoo's builders (0.6 s)
    code = (
        "import sys; from tensoropt.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('numba', 'sympy', 'tensoropt.search.solver', 'onnx', "
        "'tensoropt.models.zoo') "
        "if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
