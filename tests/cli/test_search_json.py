"""The compact search JSON: points are index vectors into per-mesh strategy tables, and
``compile --pick POLICY --search FILE`` expands them into the plans the search built."""

from __future__ import annotations

import json

import pytest

from tensoropt.cli.search_json import PickedRow, SearchFile, plan_of, search_document
from tensoropt.cost.cluster import load_cluster
from tensoropt.search.driver import device_frontier, explore, plan_from_choice
from tests.cli.cli_run import assert_bad_input, cli
from tests.helpers.program import graph_of

pytest.importorskip("matplotlib")


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_every_point_expands_to_the_plan_the_search_built(zoo_file, name):
    sg = graph_of(zoo_file(name))
    profile = load_cluster("h100")
    exp = explore(sg, [1, 2, 4], "auto", profile, jobs=1)
    doc = json.loads(json.dumps(search_document(sg, profile, exp, "m.onnx", {})))
    sf = SearchFile("m.json", doc)
    checked = 0
    for d in (1, 2, 4):
        for i, (search, point) in enumerate(device_frontier(exp, d)):
            row = doc["per_device"][str(d)][i]
            assert (row["time_s"], row["memory_bytes"]) == (point.time_s, point.memory_bytes)
            ours = plan_of(sf, PickedRow(d, i, row), "s").to_json()
            assert ours == plan_from_choice(search, point.choice, "s").to_json()
            checked += 1
    assert checked == sum(len(v) for v in doc["per_device"].values()) > 3
    # each mesh keeps exactly the strategies its points use
    for search in exp.searches:
        choices = [p.choice for d in (1, 2, 4) for s, p in device_frontier(exp, d) if s is search]
        used = [len({c[k] for c in choices}) for k in range(len(search.unit_names))]
        assert [len(u) for u in doc["meshes"][_key(search)]["strategies"]] == used


def _key(search) -> str:
    return "x".join(map(str, search.mesh.shape))


@pytest.fixture(scope="module")
def searched(zoo_file, tmp_path_factory):
    """The tiny GPT searched at 1, 2 and 4 devices into a JSON file."""
    from tensoropt.cli import main

    path = tmp_path_factory.mktemp("search") / "s.json"
    assert (
        main(["search", str(zoo_file("gpt")), "--devices", "1,2,4", "--json-out", str(path)]) == 0
    )
    return path


@pytest.mark.parametrize(("policy", "devices"), [("min-memory", 4), ("1", 2), ("fastest", 4)])
def test_compile_from_the_file_equals_compile_after_a_search(
    zoo_file, searched, tmp_path, capsys, policy, devices
):
    """Same plan and same estimate as `compile --pick` searching itself, and the estimate
    is the point's own figures."""
    common = ["compile", zoo_file("gpt"), "--devices", devices, "--pick", policy, "--json"]
    from_file = cli(capsys, *common, "--search", searched, "-o", tmp_path / "a")
    again = cli(capsys, *common, "-o", tmp_path / "b")
    assert from_file.code == again.code == 0, from_file.err + again.err
    a, b = json.loads(from_file.out), json.loads(again.out)
    assert a["estimate"] == b["estimate"]
    plan_a = json.loads((tmp_path / "a" / "plan.json").read_text())
    plan_b = json.loads((tmp_path / "b" / "plan.json").read_text())
    assert plan_a["units"] == plan_b["units"] and plan_a["mesh"] == plan_b["mesh"]
    rows = json.loads(searched.read_text())["per_device"][str(devices)]
    row = rows[-1 if policy == "min-memory" else 0 if policy == "fastest" else int(policy)]
    assert a["estimate"]["time_s"] == pytest.approx(row["time_s"], rel=1e-12)
    assert a["estimate"]["memory_bytes"] == row["memory_bytes"]
    assert str(searched) in a["plan_source"]


def test_fewest_devices_under_reads_the_file(searched, zoo_file, tmp_path, capsys):
    doc = json.loads(searched.read_text())
    low = {int(d): min(r["memory_bytes"] for r in rows) for d, rows in doc["per_device"].items()}
    assert low[4] < low[2] < low[1]
    budget = (low[4] + low[2]) // 2  # only 4 devices fit
    argv = ["compile", zoo_file("gpt"), "--devices", 4, "--search", searched, "--json"]
    out = cli(capsys, *argv, "--pick", f"fewest-devices-under:{budget}B", "-o", tmp_path / "o")
    assert out.code == 0, out.err
    data = json.loads(out.out)
    assert data["world_size"] == 4 and data["estimate"]["memory_bytes"] <= budget


def test_a_budget_the_file_cannot_meet_names_the_axes_it_left_out(
    searched, zoo_file, tmp_path, capsys
):
    """The file records the axes its search explored; a --pick budget below its least
    memory names the memory axes it did not (a file without the record: no advice)."""
    doc = json.loads(searched.read_text())
    assert doc["axes_searched"] == ["split"]
    argv = ["compile", zoo_file("gpt"), "--devices", 2, "--pick", "fastest-under:1KiB"]
    out = cli(capsys, *argv, "--search", searched, "-o", tmp_path / "o")
    assert_bad_input(out, "compile", "smallest memory at 2 devices", "search --axes split,zero")
    doc.pop("axes_searched")
    older = tmp_path / "older.json"
    older.write_text(json.dumps(doc))
    out = cli(capsys, *argv, "--search", older, "-o", tmp_path / "o")
    assert "--axes" not in assert_bad_input(out, "compile", "smallest memory at 2 devices")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("mutate", "extra", "fragment"),
    [
        (None, ["--optimizer", "adam"], "searched with --optimizer 'sgd'"),
        (None, ["--cluster", "v100"], "searched on cluster 'h100'"),
        (lambda d: d.update(schema="tensoropt.search/1"), [], "tensoropt.search/1"),
        (lambda d: d.pop("meshes"), [], "missing 'meshes'"),
        (lambda d: d["per_device"]["2"][0].update(choice=[99] * 3), [], "choices for"),
        (
            lambda d: [m.update(axes={"micro_batches": "two"}) for m in d["meshes"].values()],
            [],
            "unreadable axes",
        ),
    ],
)
def test_a_file_that_does_not_fit_is_one_line(
    searched, zoo_file, tmp_path, capsys, mutate, extra, fragment
):
    path = searched
    if mutate is not None:
        doc = json.loads(searched.read_text())
        mutate(doc)
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(doc))
    argv = ["compile", zoo_file("gpt"), "--devices", 2, "--pick", "fastest", "--search", path]
    out = cli(capsys, *argv, *extra, "-o", tmp_path / "o")
    assert_bad_input(out, "compile", fragment)
    assert not (tmp_path / "o").exists()


def test_compile_takes_the_settings_it_was_not_given_from_the_file(zoo_file, tmp_path, capsys):
    """A file searched with --optimizer adam on a100 compiles without repeating them: the
    compile says what it took, prices the point as the search did, and its step updates
    with Adam. A cluster that is no built-in profile is not taken by name."""
    path = tmp_path / "adam.json"
    model = zoo_file("gpt")
    searched = cli(capsys, "search", model, "--devices", 2, "--optimizer", "adam",
                   "--cluster", "a100", "--json-out", path)  # fmt: skip
    assert searched.code == 0, searched.err
    argv = ["compile", model, "--devices", 2, "--pick", "fastest", "--search", path, "--json"]
    out = cli(capsys, *argv, "-o", tmp_path / "o")
    assert out.code == 0, out.err
    assert f"--search {path}: compiling with its --optimizer adam, --cluster a100" in out.err
    row = json.loads(path.read_text())["per_device"]["2"][0]
    estimate = json.loads(out.out)["estimate"]
    assert estimate["time_s"] == pytest.approx(row["time_s"], rel=1e-12)
    assert estimate["memory_bytes"] == row["memory_bytes"]
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert manifest["step"]["optimizer"]["kind"] == "adam"
    # given alike: nothing to say; given otherwise: refused as before
    same = cli(capsys, *argv, "--optimizer", "adam", "--cluster", "a100", "-o", tmp_path / "s")
    assert same.code == 0 and "compiling with its" not in same.err
    other = cli(capsys, *argv, "--optimizer", "sgd", "-o", tmp_path / "x")
    assert_bad_input(other, "compile", "searched with --optimizer 'adam'")
    # a profile from a file: its name is not a profile compile can load
    doc = json.loads(path.read_text())
    doc["cluster"]["name"] = "lab"
    lab = tmp_path / "lab.json"
    lab.write_text(json.dumps(doc))
    out = cli(capsys, "compile", model, "--devices", 2, "--pick", "fastest", "--search", lab,
              "-o", tmp_path / "y")  # fmt: skip
    assert_bad_input(out, "compile", "searched on cluster 'lab'", "--cluster")


def test_search_file_errors(zoo_file, searched, tmp_path, capsys):
    base = ["compile", zoo_file("gpt"), "-o", tmp_path / "o"]
    missing = cli(capsys, *base, "--devices", 2, "--pick", "fastest", "--search", tmp_path / "x")
    assert_bad_input(missing, "compile", "no such file", "--json-out")
    (tmp_path / "junk.json").write_text("{not json")
    junk = cli(
        capsys, *base, "--devices", 2, "--pick", "fastest", "--search", tmp_path / "junk.json"
    )
    assert_bad_input(junk, "compile", "not a readable JSON file")
    no_pick = cli(capsys, *base, "--devices", 2, "--search", searched)
    assert_bad_input(no_pick, "compile", "give --pick")
    absent = cli(capsys, *base, "--devices", 8, "--pick", "fastest", "--search", searched)
    assert_bad_input(absent, "compile", "no frontier at 8 devices", "1, 2, 4")
    meshed = cli(
        capsys, *base, "--devices", 4, "--mesh", "2x2", "--pick", "0", "--search", searched
    )
    assert_bad_input(meshed, "compile", "--mesh 2x2 with --search")
    axes = cli(capsys, *base, "--devices", 2, "--pick", "0", "--search", searched, "--axes", "zero")
    assert_bad_input(axes, "compile", "--search FILE already holds its search's points")
    assert not (tmp_path / "o").exists()


def test_no_plan_that_replicates_all_work_is_called_data_parallel(zoo_file, capsys):
    """Batch 8 on 3 devices cannot be split: no data-parallel reference there, and every
    point or reference on several devices that splits nothing says so."""
    from tensoropt.cost.summary import ALL_REPLICATED

    out = cli(capsys, "search", zoo_file("gpt"), "--devices", "1-4", "--json")
    doc = json.loads(out.out)
    dp = {r["devices"] for r in doc["references"] if r["plan"] == "data-parallel"}
    assert dp == {1, 2, 4}
    for ref in doc["references"]:
        if ref["devices"] > 1:
            assert ref["summary"] != ALL_REPLICATED and "=" in ref["summary"], ref
    replicated = [
        row for rows in doc["per_device"].values() for row in rows if row["replicates_all_work"]
    ]
    # at 3 devices every point replicates the split part of the step (the memory axes
    # still trade time for memory on each device)
    assert doc["per_device"]["3"] and all(row in replicated for row in doc["per_device"]["3"])
    for row in replicated:
        assert row["summary"].startswith(ALL_REPLICATED) and row["mesh"] != [1]
