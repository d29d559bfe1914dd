"""``tensoropt validate``: estimates against measured runs, JSON, plot, infeasible models."""

from __future__ import annotations

import json
import os
import shutil
import statistics

import pytest

from tensoropt.calibrate.validate import by_memory_link, rel_error, select_points
from tensoropt.cli import main
from tensoropt.cost.accuracy import band_of
from tests.helpers.figures import legends_beside_their_axes, record_saved

from .conftest import load

pytestmark = pytest.mark.mpi


def test_select_points_keeps_both_ends_evenly_spaced():
    assert select_points(10, 4) == [0, 3, 6, 9]
    assert select_points(3, 4) == [0, 1, 2]
    assert select_points(1, 4) == [0]
    assert select_points(5, 1) == [0]
    assert select_points(0, 4) == []


def test_rel_error_sign():
    assert rel_error(1.2, 1.0) == pytest.approx(0.2)
    assert rel_error(0.5, 1.0) == pytest.approx(-0.5)


def test_step_time_errors_split_by_the_memory_link_probed_before_each_plan():
    from types import SimpleNamespace

    from tensoropt.calibrate.memlink import LinkProbe

    own, shared = LinkProbe(4e10, 3.9e10, 2), LinkProbe(4e10, 2e10, 2)
    checks = [
        SimpleNamespace(time_error=e, link=link)
        for e, link in [(0.1, own), (-0.3, own), (0.05, own), (-0.4, shared), (0.2, None)]
    ]
    groups = by_memory_link(checks)
    assert groups["own"] == {
        "plans": 3,
        "median_time_rel_error": pytest.approx(0.1),
        "signed_median_time_rel_error": pytest.approx(0.05),
    }
    assert groups["shared"]["plans"] == 1
    assert groups["shared"]["signed_median_time_rel_error"] == pytest.approx(-0.4)
    assert by_memory_link(checks[4:]) == {}  # unprobed plans (one device) count nowhere


def test_table_labels_pipelined_meshes_as_the_search_does():
    from types import SimpleNamespace

    from tensoropt.calibrate.validate import mesh_text

    plain = SimpleNamespace(mesh=(2, 2), axes={"stages": 1})
    staged = SimpleNamespace(mesh=(1,), axes={"stages": 2})
    bare = SimpleNamespace(mesh=(4,), axes=None)
    assert [mesh_text(c) for c in (plain, staged, bare)] == ["2x2", "pp2:1", "4"]


def test_median_round_keeps_the_middle_run_whole():
    from types import SimpleNamespace

    from tensoropt.cli.cmd_validate import _median_round

    def run(*steps):
        ranks = tuple(SimpleNamespace(step_s=s) for s in steps)
        return SimpleNamespace(profile=SimpleNamespace(ranks=ranks), link=None, host=None)

    # the step of a run is its slowest rank's; a disturbed run (9.0) is never kept
    runs = [run(1.0, 9.0), run(2.0, 2.5), run(3.0, 1.0)]
    assert _median_round(runs) is runs[2]
    assert _median_round(runs[:2]) is runs[1]  # even count: the lower middle
    assert _median_round(runs[:1]) is runs[0]


@pytest.mark.slow
def test_validate_tiny_model_end_to_end(quick_profile, zoo_model, tmp_path, capsys, monkeypatch):
    model = zoo_model("mlp")
    drawn = record_saved(monkeypatch)
    out, png = tmp_path / "v.json", tmp_path / "v.png"
    profile = tmp_path / "p.json"
    shutil.copy(quick_profile, profile)
    code = main([
        "validate", str(model), "--devices", "1,2", "--cluster", str(profile),
        "--points", "2", "--steps", "3", "--warmup", "1",
        "--json-out", str(out), "--plot", str(png), "--record",
    ])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads(out.read_text())
    assert data["schema"] == "tensoropt.validate/1"
    # the scatters' legends sit beside their axes, clear of the points in the corners
    assert len(drawn) == 1 and legends_beside_their_axes(drawn) == 2
    assert data["threads_per_rank"] == load(quick_profile)["calibration"]["threads_per_rank"]
    results = data["results"]
    assert {r["devices"] for r in results} == {1, 2}
    assert all(len(r["measured"]["ranks"]) == r["devices"] for r in results)
    for r in results:
        est, meas = r["estimate"], r["measured"]
        assert est["time_s"] > 0 and meas["time_s"] > 0 and meas["memory_bytes"] > 0
        assert est["liveness_peak_bytes"] > 0
        assert r["time_rel_error"] == pytest.approx(
            (est["time_s"] - meas["time_s"]) / meas["time_s"]
        )
        assert 0 <= est["compute_s"] <= est["time_s"]
        # the host's memory link, probed before each multi-device plan ran (mpi)
        link = meas["memory_link"]
        if r["devices"] == 1 or (os.cpu_count() or 1) < 2:
            assert link is None
        else:
            assert link["processes"] == 2 and link["alone_Bps"] > 0 and link["ratio"] > 0
        # the host's speed around the run against the calibration's (hostspeed)
        host = meas["host_speed_ratio"]
        assert host > 0
        assert r["time_rel_error_host_corrected"] == pytest.approx(
            rel_error(est["time_s"] * host, meas["time_s"])
        )
        # three rounds by default; the reported run is the median of them
        rounds = meas["round_times_s"]
        assert len(rounds) == 3 and meas["time_s"] == sorted(rounds)[1]
    shared = [r for r in results if (r["measured"]["memory_link"] or {}).get("shared")]
    assert data["plans_on_shared_memory_link"] == len(shared)
    # --record keeps each plan's memory link, and the band reports the plans per link
    links = [
        None if r["measured"]["memory_link"] is None
        else ("shared" if r["measured"]["memory_link"]["shared"] else "own")
        for r in results
    ]  # fmt: skip
    assert [p["link"] for p in load(profile)["accuracy"]["plans"]] == links
    link = band_of(str(profile)).link
    for kind in ("own", "shared"):
        errors = [r["time_rel_error"] for r, k in zip(results, links, strict=True) if k == kind]
        found = getattr(link, kind) if link is not None else None
        assert found == ((len(errors), statistics.median(errors)) if errors else None)
    corrected = sorted(abs(r["time_rel_error_host_corrected"]) for r in results)
    assert data["median_time_rel_error_host_corrected"] == pytest.approx(
        (corrected[(len(corrected) - 1) // 2] + corrected[len(corrected) // 2]) / 2
    )
    errors = sorted(abs(r["time_rel_error"]) for r in results)
    median = (errors[(len(errors) - 1) // 2] + errors[len(errors) // 2]) / 2
    assert data["median_time_rel_error"] == pytest.approx(median)
    assert data["median_memory_rel_error"] >= 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = captured.out.splitlines()
    assert table[0].split()[:3] == ["dev", "mesh", "pt"]
    summary = [i for i, line in enumerate(table) if line.startswith("median |relative error|")]
    assert summary == [len(results) + 1]  # after the header and one line per plan
    assert table[summary[0]].startswith(f"median |relative error| over {len(results)} plans")
    assert "link" in table[0].split() and "host" in table[0].split()
    assert table[summary[0] + 1].startswith("host: the reference ran x")
    probed = [r for r in results if r["measured"]["memory_link"] is not None]
    groups = data["time_rel_error_by_memory_link"]
    assert sum(g["plans"] for g in groups.values()) == len(probed)
    for name, g in groups.items():
        signed = sorted(
            r["time_rel_error"]
            for r in probed
            if r["measured"]["memory_link"]["shared"] is (name == "shared")
        )
        assert g["plans"] == len(signed)
        mid = (signed[(len(signed) - 1) // 2] + signed[len(signed) // 2]) / 2
        assert g["signed_median_time_rel_error"] == pytest.approx(mid)
    if shared:  # the plans that ran on a shared link are counted under the median
        assert table[-2].startswith(f"{len(shared)} of ")
        assert table[-1].startswith("step time by memory link (the estimate assumes one per")


@pytest.mark.slow
def test_validate_takes_the_memory_axes_and_prices_their_compute(
    quick_profile, zoo_model, tmp_path, capsys
):
    """Points with recomputed blocks and micro-batches compile, run and are compared; each
    result names its axes, and on one device (no collectives) the compute estimate, the
    plan priced with free communication as compile prices it, is the whole estimate."""
    model = zoo_model("gpt")
    out = tmp_path / "v.json"
    code = main([
        "validate", str(model), "--devices", "1", "--cluster", str(quick_profile),
        "--axes", "split,recompute,micro", "--micro-batches", "1,4", "--points", "2",
        "--steps", "3", "--warmup", "1", "--json-out", str(out),
    ])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    results = json.loads(out.read_text())["results"]
    axes = [r["axes"] for r in results]
    assert any(a["recompute_blocks"] > 0 or a["micro_batches"] > 1 for a in axes), axes
    for r in results:
        est = r["estimate"]
        assert est["compute_s"] == pytest.approx(est["time_s"], rel=1e-9), r["axes"]
        assert est["comm_s"] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.slow
def test_model_that_fits_nowhere_exits_2(quick_profile, zoo_model, tmp_path, capsys):
    data = load(quick_profile)
    # 1 MiB per device (the least a profile takes): the small mlp's 12 MiB of weights fit
    # no plan on 1 or 2 devices
    data["memory_bytes"] = float(2**20)
    small = tmp_path / "small.json"
    small.write_text(json.dumps(data))
    model = str(zoo_model("mlp", "small"))
    code = main(["validate", model, "--devices", "1,2", "--cluster", str(small)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("tensoropt validate: error: ")
    assert "does not fit at 1, 2 devices" in err[0]


def test_validate_needs_a_cluster(zoo_model, capsys):
    code = main(["validate", str(zoo_model("mlp"))])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--cluster is required" in err[0]


def test_more_ranks_than_cores_is_named():
    from tensoropt.cli.cmd_validate import oversubscribed

    assert oversubscribed(2, 1, cores=2) is None
    assert oversubscribed(1, 2, cores=2) is None
    crowded = oversubscribed(4, 1, cores=2)
    assert crowded is not None and "4 ranks x 1 thread(s) need 4 cores" in crowded
    assert "has 2" in crowded and "at most 2 device(s)" in crowded
    assert "at most 1 device(s)" in oversubscribed(2, 2, cores=2)


@pytest.mark.slow
def test_validate_warns_when_ranks_outnumber_cores(quick_profile, zoo_model, capsys):
    cores = os.cpu_count() or 1
    code = main([
        "validate", str(zoo_model("mlp")), "--devices", "1", "--cluster", str(quick_profile),
        "--threads", str(cores + 1), "--points", "1", "--steps", "2", "--warmup", "1",
    ])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"validate: warning: 1 rank x {cores + 1} thread(s) need {cores + 1} cores" in err
