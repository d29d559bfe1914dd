"""``tensoropt calibrate``: a valid, complete profile that search accepts; bad files refused."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import pytest

from tensoropt.calibrate.kernels import OWN_CURVE_OPS
from tensoropt.cli import main
from tensoropt.cli.cmd_calibrate import _summary
from tensoropt.cost.cluster import load_cluster
from tensoropt.cost.compute import family
from tensoropt.errors import TensorOptError
from tests.helpers.procs import catches, has_children, wait_for

from .conftest import load

pytestmark = pytest.mark.mpi

FAMILIES = {"matmul", "conv", "elementwise", "reduce", "softmax", "norm", "pool"}
CURVES = FAMILIES | set(OWN_CURVE_OPS)  # the zoo's activations have curves of their own


@pytest.mark.slow
def test_quick_profile_has_every_rate_and_family(quick_profile):
    data = load(quick_profile)
    profile = load_cluster(str(quick_profile))
    assert set(profile.op_throughput) == CURVES
    assert set(profile.op_curves) == CURVES
    assert set(profile.op_backward) == CURVES
    assert profile.devices_per_node == 2
    assert profile.intra == profile.inter
    assert profile.op_floor_s > 0 and profile.peak_flops > 0 and profile.memory_bandwidth > 0
    # the matmul curve is keyed by FLOPs and covers small to large sizes
    sizes = [p[0] for p in profile.op_curves["matmul"].points]
    assert profile.op_curves["matmul"].work == "flops" and max(sizes) / min(sizes) > 100
    assert profile.op_curves["elementwise"].work == "bytes"
    assert profile.peak_flops == max(r for _, r in profile.op_curves["matmul"].points)
    ((side, grid),) = profile.op_train_grids["matmul"]  # quick: 16, 64, 256 rows x 64, 512
    assert side == 1 and grid.rows == (16.0, 64.0, 256.0) and grid.sides == (64.0, 512.0)
    # quick: 1x1 and 3x3 kernels, channels 8, 32, 128 x output sides 2, 4, 16 (batch 8)
    convs = dict(profile.op_train_grids["conv"])
    assert sorted(convs) == [1, 3]
    for conv in convs.values():
        assert conv.rows == (8.0, 32.0, 128.0) and conv.sides == (32.0, 128.0, 2048.0)
    ((side, norm),) = profile.op_train_grids["batchnorm"]
    assert side == 1 and norm.rows == conv.rows and norm.sides == conv.sides
    grids = (grid, *convs.values(), norm)
    assert all(r > 0 for g in grids for row in g.rates for r in row)
    cal = data["calibration"]
    assert cal["ranks"] == 2 and cal["threads_per_rank"] == max(1, (os.cpu_count() or 1) // 2)
    assert cal["backend"] == "mpi" and cal["repeats"] == 3 and cal["launches"] == 3
    assert cal["compute_clock"] == ("thread_cpu" if cal["threads_per_rank"] == 1 else "wall")
    assert cal["compute_caches"] == "cold"
    # quick: one compute pass, no extra repeats
    assert cal["compute_passes"] == 1 and cal["passes_apart"] == {}
    assert cal["max_repeats"] == 3 and cal["repeated_more"] == []
    # compute timed alone; the host's memory link probed before the pass and after it
    assert cal["compute_neighbours"] == 0
    if (os.cpu_count() or 1) >= 2:
        assert [p["processes"] for p in cal["memory_link"]] == [2, 2]
        assert all(p["alone_Bps"] > 0 and p["together_Bps"] > 0 for p in cal["memory_link"])
        # the streaming floor's rate: the probes' median one-process rate
        alone = sorted(p["alone_Bps"] for p in cal["memory_link"])
        assert data["memory_bandwidth"] == pytest.approx((alone[0] + alone[1]) / 2, rel=1e-6)
        assert cal["memory_bandwidth_from"] == "memory-link probes (median of 2)"
    # the host-speed reference (calibrate.hostspeed), timed before the pass and after it
    assert len(cal["host_references_s"]) == 2 and all(x > 0 for x in cal["host_references_s"])
    assert cal["host_reference_s"] == pytest.approx(sum(cal["host_references_s"]) / 2, abs=1e-6)
    # the summary shows the range they took (what calibrate warns on, drift_warning)
    low, high = min(cal["host_references_s"]), max(cal["host_references_s"])
    assert f"host speed: reference graph {low * 1e3:.2f}-{high * 1e3:.2f} ms over 2" in (
        _summary(data)
    )
    assert data["machine"]["cores"] == os.cpu_count()
    assert data["memory_bytes"] == data["machine"]["memory_bytes"] > 0
    assert data["versions"]["onnxruntime"] and data["versions"]["mpi4py"]
    assert set(data["collectives"]["per_kind"]) == {
        "AllReduce", "AllGather", "ReduceScatter", "AllToAll"
    }  # fmt: skip


@pytest.mark.slow
def test_every_entry_records_its_spread(quick_profile):
    data = load(quick_profile)
    spread = data["spread"]
    assert set(spread["op_throughput"]) == CURVES
    assert set(spread["collectives"]) == set(data["collectives"]["per_kind"])
    for fam, curve in data["op_curves"].items():
        for point in curve["points"]:
            assert len(point) == 3 and point[2] >= 0, (fam, point)
        op_types = {label.split()[0] for label in curve["cases"]}
        if fam in OWN_CURVE_OPS:
            assert op_types == {fam}
        else:
            assert all(family(t) == fam and t not in OWN_CURVE_OPS for t in op_types)
    for kind, fit in data["collectives"]["per_kind"].items():
        sizes = [p[0] for p in fit["points"]]
        assert sizes == sorted(sizes) and sizes[0] <= 64 and sizes[-1] >= 1 << 22, kind
        assert all(len(p) == 3 and p[1] > 0 and p[2] >= 0 for p in fit["points"])
        assert fit["alpha_s"] >= 0 and fit["bandwidth"] > 0


@pytest.mark.slow
def test_search_accepts_the_calibrated_profile(quick_profile, zoo_model, capsys, tmp_path):
    model = zoo_model("mlp")
    fastest, used = {}, {}
    for cluster in (str(quick_profile), "h100"):
        out = tmp_path / "s.json"
        code = main(["search", str(model), "--devices", "1,2", "--cluster", cluster,
                     "--json-out", str(out)])  # fmt: skip
        assert code == 0, capsys.readouterr().err
        result = json.loads(out.read_text())
        times = [p["time_s"] for p in result["frontier"]]
        assert times and all(math.isfinite(t) and t > 0 for t in times)
        fastest[cluster] = min(times)
        used[cluster] = result["cluster"]
    mine = used[str(quick_profile)]
    data = load(quick_profile)
    assert mine["name"] == data["name"] and mine["peak_flops"] == data["peak_flops"]
    assert mine["intra"] == data["intra"] and set(mine["op_curves"]) == CURVES
    assert fastest[str(quick_profile)] != fastest["h100"]


def _bad(tmp_path, capsys, profile: dict, *fragments: str, model) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(profile))
    capsys.readouterr()
    code = main(["search", str(model), "--devices", "1", "--cluster", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("tensoropt search: error: ")
    for fragment in fragments:
        assert fragment in err[0], (fragment, err[0])


@pytest.mark.slow
@pytest.mark.parametrize(
    "edit, fragments",
    [
        (lambda d: d.pop("peak_flops"), ("every rate", "peak_flops")),
        (lambda d: d.pop("memory_bandwidth"), ("missing rate", "memory_bandwidth")),
        (lambda d: d.pop("intra"), ("missing link", "intra")),
        (lambda d: d.__setitem__("memory_bandwidth", -1.0), ("memory_bandwidth", "-1.0")),
        (lambda d: d["intra"].__setitem__("bandwidth", -5), ("intra.bandwidth", "-5")),
        (lambda d: d["op_throughput"].__setitem__("matmul", 0), ("op_throughput.matmul",)),
        (lambda d: d["op_curves"]["conv"]["points"][0].__setitem__(1, -2.0), ("op_curves.conv",)),
        (lambda d: d["op_curves"]["norm"].__setitem__("work", "joules"), ("op_curves.norm",)),
        (
            lambda d: d["collectives"]["per_kind"]["AllReduce"].__setitem__("bandwidth", -1.0),
            ("collectives.per_kind.AllReduce.bandwidth", "-1.0"),
        ),
    ],
)
def test_missing_or_negative_rates_exit_2(quick_profile, zoo_model, tmp_path, capsys, edit,
                                          fragments):  # fmt: skip
    data = load(quick_profile)
    edit(data)
    _bad(tmp_path, capsys, data, str(tmp_path / "bad.json"), *fragments, model=zoo_model("mlp"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "group"),
    [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True)],
    ids=["sigint", "sigterm", "ctrl-c-to-the-process-group"],
)
def test_interrupted_calibration_leaves_no_file(tmp_path, sig, group):
    out = tmp_path / "cluster.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensoropt", "calibrate", "-o", str(out), "--backend", "local"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # xdist workers may ignore SIGINT, and a child inherits an ignored signal (Python
        # then never raises KeyboardInterrupt): give the child the default disposition.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )  # fmt: skip
    # measuring: the command's handlers installed and its first measuring process started
    # (the calibration takes ~30 s in all)
    wait_for(
        lambda: catches(proc.pid, signal.SIGTERM) and has_children(proc.pid),
        lambda: proc.poll() is None,
        120,
    )
    if group:  # a terminal's Ctrl-C: every process of the group, the measuring one too
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=180)  # generous: CI machines may be loaded
    assert proc.returncode == 130, (stdout, stderr)
    # progress records (stderr is a pipe: "calibrate: done/total ..."), then one line
    # (a loaded machine adds one warning line first: other work shares it)
    lines = [ln for ln in stderr.strip().splitlines() if "calibrate: warning: load" not in ln]
    ended = "terminated" if sig == signal.SIGTERM else "interrupted"
    assert lines[-1] == f"tensoropt calibrate: {ended}"
    assert all(line.startswith("calibrate: ") and " elapsed, " in line for line in lines[:-1]), (
        lines
    )
    # interrupted inside the first pass: neither the file, nor a temporary, nor a
    # partial file (no pass was finished)
    assert list(tmp_path.iterdir()) == []


def test_launches_default_is_the_benchmarks():
    from tensoropt.calibrate.collectives import DEFAULT_LAUNCHES
    from tensoropt.cli import build_parser

    calibrate = build_parser()._subparsers._group_actions[0].choices["calibrate"]
    (launches,) = [a for a in calibrate._actions if a.dest == "launches"]
    assert launches.default == DEFAULT_LAUNCHES


def test_passes_help_states_the_default_calibration_uses():
    from tensoropt.calibrate.profile import DEFAULT_PASSES, CalibrateOptions
    from tensoropt.cli import build_parser

    calibrate = build_parser()._subparsers._group_actions[0].choices["calibrate"]
    (passes,) = [a for a in calibrate._actions if a.dest == "passes"]
    assert passes.default is None and f"default {DEFAULT_PASSES};" in passes.help
    assert CalibrateOptions().compute_passes == DEFAULT_PASSES
    assert CalibrateOptions(quick=True).compute_passes == 1 and "--quick: 1" in passes.help


@pytest.mark.parametrize(
    "flag",
    [
        ["--ranks", "1"],
        ["--launches", "0"],
        ["--passes", "0"],
        ["--neighbours", "-1"],
        ["--neighbours", str(os.cpu_count() or 1)],  # no core left for the measured process
    ],
)
def test_bad_options_exit_2(tmp_path, capsys, flag):
    before = signal.getsignal(signal.SIGTERM)
    code = main(["calibrate", "-o", str(tmp_path / "x.json"), *flag])
    # the SIGTERM handler of a run is put back (forked search workers would inherit it)
    assert signal.getsignal(signal.SIGTERM) is before
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and " ".join(flag) in err[0]
    assert not (tmp_path / "x.json").exists()


def test_a_second_calibration_into_the_same_output_is_refused(tmp_path):
    # two calibrations writing one output would replace each other's partial file
    from tensoropt.calibrate.partial import exclusive

    out = tmp_path / "here.json"
    with exclusive(str(out)):
        busy = subprocess.run(
            [sys.executable, "-m", "tensoropt", "calibrate", "--quick", "-o", str(out)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        with exclusive(str(tmp_path / "other.json")):  # another output is free
            pass
    lines = busy.stderr.strip().splitlines()
    assert busy.returncode == 2 and len(lines) == 1, busy.stderr
    assert "another calibration is writing" in lines[0] and str(out) in lines[0]
    assert not out.exists() and not (tmp_path / "here.json.partial").exists()
    with exclusive(str(out)):  # released with the block: the next one may calibrate
        pass


def test_the_hold_on_an_output_dies_with_its_process(tmp_path):
    from tensoropt.calibrate.partial import exclusive

    out = tmp_path / "here.json"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from tensoropt.calibrate.partial import exclusive\n"
         f"with exclusive({str(out)!r}):\n    print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with (
            pytest.raises(TensorOptError, match="another calibration is writing"),
            exclusive(str(out)),
        ):
            pass
        holder.kill()  # SIGKILL: no cleanup runs, and nothing is left on disk
        holder.wait()
        with exclusive(str(out)):
            pass
        assert list(tmp_path.iterdir()) == []
    finally:
        holder.kill()
