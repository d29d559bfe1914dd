"""`tensoropt search`, `compile --pick` and `demo` as a user runs them."""

from __future__ import annotations

import json
import re

import pytest

from tensoropt.cli.search_json import PickedRow, load_search, plan_of
from tensoropt.ir.costs import load_costs
from tensoropt.runtime.run import run_steps
from tensoropt.search.solver import solve
from tests.cli.cli_run import assert_bad_input, cli, cli_process

pytest.importorskip("matplotlib")


@pytest.mark.slow
def test_the_command_leaving_at_once_has_written_everything(zoo_file, tmp_path, capsys):
    """`tensoropt search` leaves with os._exit once main returns (QUICK_EXIT): in a child
    process with worker processes, its tables, its JSON file and its cost dump are
    whole, the same as main gives in this process, and the exit code is main's."""
    argv = ["search", zoo_file("gpt"), "--devices", "2,4", "--axes", "split,stages", "--jobs", "2"]
    child = cli_process(*argv, "--json-out", tmp_path / "a.json", "--dump-costs",
                        tmp_path / "a.costs")  # fmt: skip
    here = cli(capsys, *argv, "--json-out", tmp_path / "b.json", "--dump-costs",
               tmp_path / "b.costs")  # fmt: skip
    assert (child.code, here.code) == (0, 0), child.err
    assert child.out == here.out and "overall frontier" in child.out
    assert json.loads((tmp_path / "a.json").read_text()) == json.loads(
        (tmp_path / "b.json").read_text()
    )
    assert (tmp_path / "a.costs").read_bytes() == (tmp_path / "b.costs").read_bytes()
    bad = cli_process("search", tmp_path / "missing.onnx")
    assert_bad_input(bad, "search", "missing.onnx")


def test_search_prints_tables_and_writes_json_plot_costs(zoo_file, tmp_path, capsys):
    out = cli(
        capsys,
        "search",
        zoo_file("gpt"),
        "--devices",
        "1,2,4",
        "--json-out",
        tmp_path / "s.json",
        "--plot",
        tmp_path / "f.png",
        "--dump-costs",
        tmp_path / "c.json",
    )
    assert out.code == 0, out.err
    for fragment in (
        "1 device:",
        "2 devices:",
        "4 devices:",
        "overall frontier",
        "data-parallel",
        "samples/s",
        "guarantee: exact",
        # the default searches the split alone, and says what it left out
        "axes: searched split; not searched: zero, recompute, micro, stages (--axes all",
    ):
        assert fragment in out.out, fragment
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["schema"] == "tensoropt.search/2"
    assert set(data["per_device"]) == {"1", "2", "4"}
    search = load_search(str(tmp_path / "s.json"))
    for d, points in data["per_device"].items():
        times = [p["time_s"] for p in points]
        mems = [p["memory_bytes"] for p in points]
        assert times == sorted(times) and mems == sorted(mems, reverse=True)
        for i, p in enumerate(points):
            plan = plan_of(search, PickedRow(int(d), i, p), "test")
            assert plan.mesh.shape == tuple(p["mesh"]) and plan.units
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = load_costs(tmp_path / "c.json")
    assert {r.problem.devices for r in records} == {1, 2, 4}
    for record in records:  # recomputed from the file alone
        again = solve(record.problem).points
        assert [(p.time_s, p.memory_bytes) for p in again] == [
            (p.time_s, p.memory_bytes) for p in record.frontier
        ]


def test_a_reference_no_mesh_can_express_says_why(zoo_file, capsys, tmp_path):
    """At 3 devices neither the batch of 8 nor Megatron's weights split 3 ways: each
    reference the axes call for gets a line with the plan's own refusal, in the text and
    the JSON; every wanted reference of every count is either priced or missing."""
    path = tmp_path / "s.json"
    out = cli(capsys, "search", zoo_file("gpt"), "--devices", "2,3", "--axes",
              "split,zero,recompute", "--json-out", path)  # fmt: skip
    assert out.code == 0, out.err
    gaps = [line.strip() for line in out.out.splitlines() if ": none (" in line]
    assert any(g.startswith("3 devices data-parallel: none (data-parallel over 3 devices: ")
               and "which 3 does not divide)" in g for g in gaps), gaps  # fmt: skip
    assert any(g.startswith("3 devices megatron: none (megatron over 3 devices") for g in gaps)
    doc = json.loads(path.read_text())
    missing = {(r["devices"], r["plan"]): r["reason"] for r in doc["references_missing"]}
    assert [f"{_plural(d)} {name}: none ({why})" for (d, name), why in missing.items()] == gaps
    priced = {(r["devices"], r["plan"]) for r in doc["references"]}
    wanted = {(d, n) for d in (2, 3) for n in ("data-parallel", "megatron", "fsdp",
                                               "megatron+recompute")}  # fmt: skip
    assert wanted <= priced | set(missing) and not priced & set(missing)
    assert {d for d, _ in missing} == {3}  # every reference is expressible on 2 devices
    # the refusal is compile's own for the same plan and count (its mesh axis named alike)
    out = cli(capsys, "compile", zoo_file("gpt"), "--plan", "megatron", "--devices", "3",
              "-o", tmp_path / "c")  # fmt: skip
    line = assert_bad_input(out, "compile", "megatron over 3 devices on mesh axis 0 (tp)")
    assert missing[(3, "megatron")] in line, (missing, line)


def _plural(d: int) -> str:
    return f"{d} device" + ("s" if d != 1 else "")


def test_memory_budget_below_reach_names_the_smallest_memory(zoo_file, capsys):
    out = cli(capsys, "search", zoo_file("gpt"), "--devices", "1,2", "--memory-budget", "1KiB")
    line = assert_bad_input(out, "search", "1 device:", "2 devices:", "smallest memory")
    assert "fewest devices" in line or "search more devices" in line
    # the split alone was searched: the advice names the axes that trade time for memory
    assert "--axes split,zero,recompute,micro (zero, recompute, micro not searched" in line


def test_memory_budget_advice_names_only_the_memory_axes_left_out(zoo_file, capsys):
    argv = ["search", zoo_file("gpt"), "--devices", "1,2", "--memory-budget", "1KiB"]
    out = cli(capsys, *argv, "--axes", "split,zero")
    line = assert_bad_input(out, "search", "smallest memory")
    assert "(recompute, micro not searched here)" in line
    out = cli(capsys, *argv, "--axes", "split,zero,recompute,micro")
    line = assert_bad_input(out, "search", "smallest memory")
    assert "--axes" not in line


def test_budget_reports_the_fewest_devices_that_fit(zoo_file, capsys, tmp_path):
    """A budget between the 8-device and 1-device minimum: the advice names a count."""
    full = cli(
        capsys, "search", zoo_file("gpt"), "--devices", "1,8", "--json-out", tmp_path / "s.json"
    )
    assert full.code == 0
    data = json.loads((tmp_path / "s.json").read_text())
    low = {d: min(p["memory_bytes"] for p in pts) for d, pts in data["per_device"].items()}
    assert low["8"] < low["1"]
    budget = (low["8"] + low["1"]) / 2
    out = cli(
        capsys, "search", zoo_file("gpt"), "--devices", "1", "--memory-budget", f"{int(budget)}B"
    )
    assert_bad_input(out, "search", "1 device:")


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--devices", "3", "--mesh", "2x2"], ["--mesh 2x2", "device count 3"]),
        (["--cluster", "tpu-v9"], ["unknown cluster profile", "h100"]),
        (["--devices", "two"], ["--devices"]),
        (["--epsilon", "2"], ["--epsilon"]),
    ],
)
def test_bad_search_arguments(zoo_file, capsys, argv, fragments):
    assert_bad_input(cli(capsys, "search", zoo_file("mlp"), *argv), "search", *fragments)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("{not json", "not valid JSON"),
        ('{"base": "h100", "intra": {"bandwidth": -5}}', "intra.bandwidth"),
        ('{"peak_flops": 1e12}', "missing"),
        ('{"base": "h100", "warp_speed": 9}', "unknown keys"),
    ],
)
def test_malformed_cluster_file(zoo_file, capsys, tmp_path, content, fragment):
    path = tmp_path / "cluster.json"
    path.write_text(content)
    out = cli(capsys, "search", zoo_file("mlp"), "--cluster", path)
    assert_bad_input(out, "search", fragment)


def test_cluster_file_overrides_rates(zoo_file, capsys, tmp_path):
    """A slower interconnect makes the fastest multi-device plan slower."""
    path = tmp_path / "slow.json"
    path.write_text(
        json.dumps({"base": "h100", "intra": {"bandwidth": 1e8}, "inter": {"bandwidth": 1e8}})
    )
    fast = cli(
        capsys,
        "search",
        zoo_file("gpt"),
        "--devices",
        "4",
        "--mesh",
        "4",
        "--json-out",
        tmp_path / "a.json",
    )
    slow = cli(
        capsys,
        "search",
        zoo_file("gpt"),
        "--devices",
        "4",
        "--mesh",
        "4",
        "--cluster",
        path,
        "--json-out",
        tmp_path / "b.json",
    )
    assert fast.code == slow.code == 0
    a = json.loads((tmp_path / "a.json").read_text())["per_device"]["4"]
    b = json.loads((tmp_path / "b.json").read_text())["per_device"]["4"]
    assert min(p["memory_bytes"] for p in b) >= min(p["memory_bytes"] for p in a) * 0.999
    assert b[-1]["time_s"] > a[-1]["time_s"]


@pytest.mark.parametrize(
    ("name", "policy", "devices"),
    [
        ("mlp", "min-memory", 2),
        ("gpt", "min-memory", 4),
        pytest.param("gpt", "fastest", 2, marks=pytest.mark.slow),
        pytest.param("gpt", "1", 4, marks=pytest.mark.slow),
        pytest.param("rnnlm", "min-memory", 2, marks=pytest.mark.slow),
        pytest.param("resnet50", "min-memory", 2, marks=pytest.mark.slow),
        pytest.param("bert", "min-memory", 4, marks=pytest.mark.slow),
    ],
)
def test_picked_plans_really_run(zoo_file, capsys, tmp_path, name, policy, devices):
    out = cli(
        capsys,
        "compile",
        zoo_file(name),
        "--devices",
        devices,
        "--pick",
        policy,
        "-o",
        tmp_path / "out",
    )
    assert out.code == 0, out.err
    assert f"picked {policy}" in out.err
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["data_axes"] is None and plan["units"]
    report = run_steps(tmp_path / "out", 3, "local", verify=True, threads=1).verify
    assert report is not None and report.ok, report.to_json()


def test_pick_budget_and_index_errors(zoo_file, capsys, tmp_path):
    out = cli(
        capsys,
        "compile",
        zoo_file("mlp"),
        "--devices",
        "2",
        "--pick",
        "fastest-under:1KiB",
        "-o",
        tmp_path / "o",
    )
    assert_bad_input(out, "compile", "smallest memory at 2 devices")
    out = cli(
        capsys, "compile", zoo_file("mlp"), "--devices", "2", "--pick", "999", "-o", tmp_path / "o"
    )
    assert_bad_input(out, "compile", "frontier at 2 devices has")
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_compile_pick_searches_the_axes_it_is_given(zoo_file, capsys, tmp_path):
    """`compile --pick --axes LIST` picks from the frontier `search --axes LIST` shows: its
    least-memory point at 2 devices is the search's (same estimate), below the split
    alone's; a budget only the memory axes meet is met with them and refused without,
    naming them."""
    every = "split,zero,recompute,micro"
    model = zoo_file("gpt")
    found = cli(capsys, "search", model, "--devices", "2", "--axes", every, "--json")
    assert found.code == 0, found.err
    rows = json.loads(found.out)["per_device"]["2"]
    least = rows[-1]
    done = cli(capsys, "compile", model, "--devices", "2", "--pick", "min-memory",
               "--axes", every, "-o", tmp_path / "all", "--json")  # fmt: skip
    assert done.code == 0, done.err
    estimate = json.loads(done.out)["estimate"]
    assert estimate["memory_bytes"] == least["memory_bytes"]
    assert estimate["time_s"] == pytest.approx(least["time_s"], rel=1e-9)
    split = cli(capsys, "compile", model, "--devices", "2", "--pick", "min-memory",
                "-o", tmp_path / "split", "--json")  # fmt: skip
    assert split.code == 0, split.err
    assert json.loads(split.out)["estimate"]["memory_bytes"] > least["memory_bytes"]
    budget = f"{least['memory_bytes']}B"
    argv = ["compile", model, "--devices", "2", "--pick", f"fastest-under:{budget}"]
    refused = cli(capsys, *argv, "-o", tmp_path / "no")
    assert_bad_input(refused, "compile", "smallest memory at 2 devices", f"--axes {every}")
    assert not (tmp_path / "no").exists()
    met = cli(capsys, *argv, "--axes", every, "-o", tmp_path / "yes")
    assert met.code == 0, met.err


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--axes", "split,zero"], "give --pick"),
        (["--pick", "fastest", "--axes", "split,bogus"], "unknown axis 'bogus'"),
    ],
)
def test_compile_axes_needs_a_pick_search(zoo_file, capsys, tmp_path, extra, fragment):
    out = cli(capsys, "compile", zoo_file("mlp"), "--devices", "2", *extra, "-o", tmp_path / "o")
    assert_bad_input(out, "compile", fragment)
    assert not (tmp_path / "o").exists()


def test_epsilon_search_states_the_device_count_guarantee(zoo_file, tmp_path, capsys):
    """With --epsilon the meshes of a count prune each other as in the exact search, and
    the guarantee is stated for each count's frontier, in the table and the JSON."""
    out = cli(
        capsys,
        "search",
        zoo_file("gpt"),
        "--devices",
        "4",
        "--epsilon",
        "0.05",
        "--json-out",
        tmp_path / "s.json",
    )
    assert out.code == 0, out.err
    line = "epsilon=0.05: for every plan P on N devices there is a point Q of the N-device"
    assert line in out.out
    assert json.loads((tmp_path / "s.json").read_text())["guarantee"].startswith(line)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("all", {"split", "zero", "recompute", "micro", "stages"}),
        ("split,all", {"split", "zero", "recompute", "micro", "stages"}),
        ("zero", {"split", "zero"}),
        ("stages", {"split", "micro", "stages"}),  # a pipeline runs micro-batches
    ],
)
def test_axes_lists_and_all(text, want):
    from tensoropt.cli.cmd_search import axes_line, parse_axes
    from tensoropt.search.driver import Axis

    assert {a.value for a in parse_axes(text)} == want
    line = axes_line(parse_axes(text))
    searched, _, rest = line.partition(";")
    assert set(searched.removeprefix("searched ").split(" ")[0].split(",")) == want
    left = [a.value for a in Axis if a.value not in want]  # in the enum's order
    if left:
        assert rest.startswith(f" not searched: {', '.join(left)} (")
    else:
        assert line.endswith("(every axis)")


@pytest.mark.parametrize(
    ("argv", "idle"),
    [
        (("--axes", "zero", "--devices", "1"), {"zero": "it needs 2 devices or more"}),
        (
            ("--axes", "micro", "--devices", "2", "--micro-batches", "1"),
            {"micro": "--micro-batches gives no count above 1"},
        ),
        (("--axes", "zero,micro", "--devices", "2"), {}),
    ],
)
def test_axes_that_give_no_problem_are_not_called_searched(zoo_file, capsys, argv, idle):
    """An asked axis none of whose plans exists (ZeRO at one device, no micro-batch count
    above 1) is named with its reason, and left out of the searched list, in the axes line
    and as the JSON's axes_idle."""
    path = zoo_file("mlp")
    out = cli(capsys, "search", path, *argv)
    assert out.code == 0, out.err
    line = next(x for x in out.out.splitlines() if x.startswith("axes: "))
    searched = line.removeprefix("axes: searched ").split(";")[0].split(" ")[0].split(",")
    for axis, why in idle.items():
        assert f"; {axis} has no plan here: {why};" in line, line
        assert axis not in searched, line
    if not idle:
        assert "has no plan here" not in line and set(argv[1].split(",")) <= set(searched)
    doc = json.loads(cli(capsys, "search", path, *argv, "--json").out)
    assert doc["axes_idle"] == idle


def test_axes_help_and_refusal_name_all(zoo_file, capsys):
    out = cli(capsys, "search", zoo_file("mlp"), "--devices", "2", "--axes", "everything")
    assert_bad_input(out, "search", "or all")
    from tensoropt.cli import main

    assert main(["search", "--help"]) == 0
    assert "all: every one of them" in " ".join(capsys.readouterr().out.split())


def test_the_tables_stay_in_line_past_four_digit_indices():
    """A frontier of 10,001 points at one device count (exact frontiers of unbalanced
    meshes reach that) and a point of 11,176 GiB (GPT-3 175B at 64 devices without a
    budget): the columns widen, so every row's columns end where the header's do."""
    import io
    from types import SimpleNamespace

    from tensoropt.cli.cmd_search import print_tables
    from tensoropt.ir.costs import FrontierPoint
    from tensoropt.ir.mesh import Mesh
    from tensoropt.report.analysis import device_frontiers
    from tensoropt.search.driver import Exploration, MeshSearch
    from tensoropt.search.merge import merge_frontiers
    from tensoropt.search.solver import SearchResult, SearchStats

    def search(devices: int, points: list[tuple[float, float]], refs=None) -> MeshSearch:
        pts = tuple(FrontierPoint(t, m, (0,)) for t, m in points)
        stats = SearchStats(0, 0, 0, 0, 0, (), 0.0)
        exact = "exact: the points are the Pareto frontier of every plan"
        result = SearchResult(devices, (devices,), pts, None, None, None, exact, stats)
        return MeshSearch(Mesh((devices,), ("dp",)), None, result, refs or {}, ("u",), (),
                          tuple("plan" for _ in pts), {})  # fmt: skip

    n = 10_001
    searches = (
        search(1, [(1.0, 1.2e13)], {"data-parallel": (1.0, 1.2e13, (0,))}),
        search(2, [(2.0 + k * 1e-3, 9e8 - k * 1e3) for k in range(n)]),
        search(1024, [(0.5, 1e8)], {"megatron": (0.5, 1e8, (0,))}),  # "1024 devices"
    )
    merged = merge_frontiers({s.key: s.result for s in searches})
    assert len(merged) == n + 2

    def ends(header: str, rows: list[str], pairs: dict[int, int]) -> None:
        """The header's token h ends where each row's token r does, for h, r in pairs
        (a time or memory cell is two tokens, its header one or two)."""
        want = [m.end() for m in re.finditer(r"\S+", header)]
        for row in rows:
            got = [m.end() for m in re.finditer(r"\S+", row)]
            assert all(want[h] == got[r] for h, r in pairs.items()), (header, row)

    exp = Exploration(searches, merged, None, None)
    out = io.StringIO()
    print_tables(SimpleNamespace(batch=8), exp, out)
    text = out.getvalue()
    # the report's (and --plot's) frontiers index the same points
    frontiers = device_frontiers(exp)
    assert [p.index for p in frontiers[2]] == list(range(n)) and len(frontiers[1]) == 1
    # the reference plans: "mesh" and the memory's unit end in one column on every line
    refs = text.split("(best mesh per device count):\n")[1].split("\n\n")[0].splitlines()
    refs = [line for line in refs if ": none (" not in line]  # the plans no mesh holds
    assert len(refs) == 2 and refs[1].lstrip().startswith("1024 devices megatron")
    ends(refs[0], refs[1:], {1: 1, 3: 3, 4: 4, 6: 6, 8: 8})  # "devices", "mesh", units

    # pick, mesh, "time" over the time's unit, "memory/dev" over the memory's unit
    for d in (1, 2):
        table = text.split(f"\n{d} device")[1].split("\n\n")[0].splitlines()
        rows = [line for line in table[2:] if line.strip()[:1].isdigit()]
        ends(table[1], rows, {0: 0, 1: 1, 3: 3, 4: 5})
    assert any(line.split()[0] == str(n - 1) for line in rows)  # a 5-digit pick
    overall = text.split("overall frontier over")[1].split("\n  (n:")[0].splitlines()
    assert overall[-1].split()[0] == str(n + 1)  # a 5-digit position
    assert overall[2].endswith(" 11175.871 GiB")  # 13 characters: wider than the header
    ends(overall[1], overall[2:], {0: 0, 1: 1, 2: 2, 3: 3, 5: 5, 6: 7})


def test_a_table_with_no_rows_prints_nothing_and_a_header_alone_keeps_its_widths():
    from tensoropt.cli.cmd_search import _columns

    assert _columns(None, [], (11, 18)) == []
    assert _columns(("n", "mesh"), [], (3, 8)) == ["    n     mesh"]
