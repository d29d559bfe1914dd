"""Error bands: `validate --record` keeps each plan's errors in the profile; `search`
and `compile` then state how far an estimate is typically off and mark the frontier
points the estimate cannot order."""

from __future__ import annotations

import json
import re
import shutil
import statistics

import pytest

from tensoropt.cli import main
from tensoropt.cost.accuracy import ErrorBand, band_of, link_record, near_tie_note, near_ties
from tensoropt.cost.cluster import load_cluster

from .conftest import load


def test_near_ties_compare_each_point_with_the_one_before():
    assert near_ties([1.0, 1.05, 1.2, 1.25, 2.0], 0.1) == [False, True, False, True, False]
    assert near_ties([1.0, 1.25], 0.25) == [False, True]  # at the band's edge: a tie
    assert near_ties([1.0, 1.05], None) == [False, False]  # no band: nothing is marked


def test_the_note_names_the_points_within_the_band_of_the_picked_one():
    band = ErrorBand(0.05, 0.2, 0.1, "validated: test")
    times = [1.0, 1.1, 1.3, 2.0]
    mems = [4 * 2**20, 3 * 2**20, 2 * 2**20, 2**20]
    note = near_tie_note(times, mems, 1, band, 2)
    assert note is not None and "point(s) 0 (1000.000 ms, 4.0 MiB), 2 (1300.000 ms" in note
    assert "+-20%" in note and " 3 (" not in note
    assert near_tie_note(times, mems, 1, band, 1) is None  # one device: +-5%, no neighbour
    assert near_tie_note(times, mems, 1, None, 2) is None


@pytest.mark.slow
def test_validate_record_keeps_each_plans_errors_in_the_profile(
    quick_profile, zoo_model, tmp_path, capsys
):
    profile = tmp_path / "p.json"
    shutil.copy(quick_profile, profile)
    assert band_of(str(profile)).source.startswith("calibration spread only")
    out = tmp_path / "v.json"
    code = main([
        "validate", str(zoo_model("mlp")), "--devices", "1", "--cluster", str(profile),
        "--points", "2", "--steps", "3", "--warmup", "1", "--backend", "local",
        "--json-out", str(out), "--record",
    ])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    results = json.loads(out.read_text())["results"]
    plans = load(profile)["accuracy"]["plans"]
    assert [(p["devices"], p["time"], p["memory"]) for p in plans] == [
        (r["devices"], r["time_rel_error"], r["memory_rel_error"]) for r in results
    ]
    assert all(p["link"] is None for p in plans)  # one device: no memory link probed
    band = band_of(str(profile))
    assert band.time_one == statistics.median(abs(r["time_rel_error"]) for r in results)
    assert band.time_multi is None  # no multi-device plan recorded
    assert band.source.startswith(f"validated: median error of {len(results)} plans")
    load_cluster(str(profile))  # the profile still loads


def test_the_link_record_reads_the_probes_and_the_plans_per_link():
    probe = {"alone_Bps": 1, "together_Bps": 1, "processes": 2}
    doc = {
        "calibration": {"memory_link": [
            {**probe, "ratio": 0.48, "shared": True},
            {**probe, "ratio": 0.93, "shared": False},
            {**probe, "ratio": 0.61, "shared": True},
        ]},
        "accuracy": {"plans": [
            {"devices": 2, "time": -0.30, "memory": 0.0, "link": "shared"},
            {"devices": 2, "time": -0.40, "memory": 0.0, "link": "shared"},
            {"devices": 2, "time": -0.05, "memory": 0.0, "link": "own"},
            {"devices": 2, "time": 0.90, "memory": 0.0},  # recorded before links were
            {"devices": 1, "time": 0.70, "memory": 0.0, "link": None},
        ]},
    }  # fmt: skip
    link = link_record(doc)
    assert (link.probes, link.shared_probes, link.ratios) == (3, 2, (0.48, 0.93))
    assert link.own == (1, -0.05) and link.shared == (2, pytest.approx(-0.35))
    text = link.describe()
    assert "sharing one in 2 of 3 probes (0.48-0.93" in text
    assert "own links -5% (1 plan), shared links -35% (2 plans)" in text
    data = link.to_json()
    assert data["assumed"] == "own" and data["validated"]["own"] == {
        "plans": 1,
        "signed_median": -0.05,
    }
    # probes only: the note says which way the other case goes
    bare = link_record({"calibration": doc["calibration"]})
    assert bare.own is None and "run slower on a shared one" in bare.describe()
    assert link_record({"calibration": {}}) is None  # nothing known: no note
    band = ErrorBand(0.05, 0.2, 0.1, "validated: test", link)
    assert band.link_note(1) is None and band.link_note(2) == text


def test_record_needs_a_profile_file(zoo_model, capsys):
    code = main(["validate", str(zoo_model("mlp")), "--cluster", "h100", "--record"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--record writes into the --cluster profile" in err[0]


def _times(profile, model, capsys) -> list[float]:
    """Step times of the 2-device frontier (fastest first) with ``profile``."""
    assert main(["search", model, "--devices", "2", "--cluster", str(profile), "--json"]) == 0
    return [r["time_s"] for r in json.loads(capsys.readouterr().out)["per_device"]["2"]]


def _banded(quick_profile, tmp_path, band: float):
    """The quick profile with recorded multi-device errors whose median is ``band``."""
    obj = load(quick_profile)
    obj["accuracy"] = {
        "plans": [{"run": "r", "model": "m", "devices": 2, "time": t, "memory": 0.1}
                  for t in (-band, band, -band)]
    }  # fmt: skip
    path = tmp_path / "banded.json"
    path.write_text(json.dumps(obj))
    return path


def _gap_band(times: list[float]) -> float:
    """A band just wider than the smallest relative step between neighbours: at least one
    point is a near-tie whatever the calibrated rates are."""
    assert len(times) >= 3
    return 1.01 * min(times[k] / times[k - 1] - 1 for k in range(1, len(times)))


@pytest.mark.slow
def test_search_marks_the_points_it_cannot_order(quick_profile, zoo_model, tmp_path, capsys):
    model = str(zoo_model("gpt"))
    band = _gap_band(_times(quick_profile, model, capsys))
    banded = _banded(quick_profile, tmp_path, band)
    out = tmp_path / "s.json"
    code = main(["search", model, "--devices", "2", "--cluster", str(banded),
                 "--json-out", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0
    assert f"step time typically within +-{band:.0%} (validated: median error of 3 plans" in text
    # the memory-link case the estimates assume, from the calibration's own probes
    probes = load(quick_profile)["calibration"]["memory_link"]
    if probes:
        shared = sum(1 for p in probes if p["shared"])
        assert "(memory link: estimates assume a memory link per rank; " in text
        assert f"sharing one in {shared} of {len(probes)} probes" in text
    doc = json.loads(out.read_text())
    assert doc["error_band"]["memory_link"] == (
        link_record(load(banded)).to_json() if probes else None
    )
    assert doc["error_band"]["time_several_devices"] == pytest.approx(band)
    rows = doc["per_device"]["2"]
    times = [r["time_s"] for r in rows]
    assert [r["near_tie_with_previous"] for r in rows] == near_ties(times, band)
    assert any(r["near_tie_with_previous"] for r in rows)
    # the table marks the shown rows against the row shown above them
    table = text[text.index("2 devices:") : text.index("(pick:")].splitlines()[2:]
    shown = [(int(ln.split()[0]), "~" in ln.split()) for ln in table if ln.strip()]
    marks = near_ties([times[i] for i, _ in shown], band)
    assert [m for _, m in shown] == marks
    if any(marks):
        assert "(~: step time within the error band of the row above" in text
    # a built-in profile has no band: no marks, and the JSON says so
    code = main(["search", model, "--devices", "2", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["error_band"] is None
    assert not any(r["near_tie_with_previous"] for r in doc["per_device"]["2"])


@pytest.mark.slow
def test_compile_pick_names_the_near_ties(quick_profile, zoo_model, tmp_path, capsys):
    model = str(zoo_model("gpt"))
    times = _times(quick_profile, model, capsys)
    band = 1.01 * (times[1] / times[0] - 1)  # point 1 is a near-tie of the fastest
    within = [k for k in range(1, len(times)) if times[k] - times[0] <= band * times[0]]
    banded = _banded(quick_profile, tmp_path, band)
    code = main(["compile", model, "--devices", "2", "--pick", "fastest",
                 "--cluster", str(banded), "-o", str(tmp_path / "out"), "--json"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert json.loads(captured.out)["error_band"]["source"].startswith("validated")
    (note,) = [ln for ln in captured.err.splitlines() if ln.startswith("near-ties:")]
    assert note.startswith("near-ties: at 2 devices, point(s) 1 (")
    named = [int(x) for x in re.findall(r"(\d+) \(\d", note.split("are within")[0])]
    assert named == within[:5]  # the nearest five, in index order
    if len(within) > 5:
        assert f"and {len(within) - 5} more" in note
