"""``tensoropt run --profile``: per-rank medians of step, compute, comm time and memory."""

from __future__ import annotations

import json

import pytest

from tensoropt.cli import main
from tensoropt.runtime.profiling import StepRecord, summarize
from tensoropt.runtime.run import run_steps
from tests.helpers.handbuilt import mlp_case, write_outdir


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    return write_outdir(mlp_case(dp=2, tp=1), tmp_path_factory.mktemp("dp2"))


def _check(profile, ranks: int, steps: int, warmup: int) -> None:
    assert [r.rank for r in profile.ranks] == list(range(ranks))
    for r in profile.ranks:
        assert r.steps == steps - warmup
        assert len(r.records) in (0, steps)  # per-step records stay in the MPI workers
        assert 0 < r.compute_s <= r.step_s
        assert r.comm_s > 0  # the data-parallel gradients are all-reduced
        # each step's parts fit in the step (medians of the parts need not add up)
        for rec in r.records:
            assert rec.compute_s + rec.comm_s <= rec.seconds * 1.001
        assert r.memory_bytes >= 0


@pytest.mark.parametrize("backend", ["local", pytest.param("mpi", marks=pytest.mark.mpi)])
def test_profile_per_rank(dp2, backend):
    result = run_steps(dp2, 5, backend=backend, profile=True, profile_warmup=2, threads=1)
    assert result.profile is not None and result.profile.warmup == 2
    _check(result.profile, 2, 5, 2)


def test_profile_off_by_default(dp2):
    assert run_steps(dp2, 2).profile is None


def test_cli_table_and_json(dp2, capsys):
    code = main(["run", str(dp2), "--steps", "4", "--profile", "--profile-warmup", "1"])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    head = lines.index("profile: medians over 3 steps after 1 warm-up")
    assert lines[head + 1].split()[:4] == ["rank", "step", "ms", "compute"]
    assert [line.split()[0] for line in lines[head + 2 : head + 4]] == ["0", "1"]
    code = main(["run", str(dp2), "--steps", "3", "--profile", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    ranks = data["profile"]["ranks"]
    assert len(ranks) == 2 and data["profile"]["warmup"] == 2
    assert set(ranks[0]) >= {"step_s", "compute_s", "comm_s", "other_s", "memory_bytes"}


def test_too_few_steps_exit_2(dp2, capsys):
    code = main(["run", str(dp2), "--steps", "2", "--profile"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "warm-up" in err[0]


def test_memory_grows_with_the_state(tmp_path):
    """A step whose parameters are 64x larger uses measurably more memory."""
    small = write_outdir(mlp_case(dp=1, tp=1), tmp_path / "small")
    big = write_outdir(mlp_case(dp=1, tp=1, d=256, h=512), tmp_path / "big")
    mem = {}
    for name, outdir in (("small", small), ("big", big)):
        prof = run_steps(outdir, 4, profile=True, profile_warmup=1, threads=1).profile
        mem[name] = prof.ranks[0].memory_bytes
    # at least the parameters and their __new outputs are resident during a step
    param_bytes = 4 * (256 * 256 + 2 * 256 * 512)
    assert mem["big"] - mem["small"] > 2 * param_bytes


def test_summary_leaves_warmup_out():
    recs = [StepRecord(k, 10.0 if k < 2 else 1.0 + k / 100, 0.5, 0.25, 100 * k) for k in range(7)]
    prof = summarize(0, recs, 2)
    assert prof.steps == 5 and prof.step_s == pytest.approx(1.04)
    assert prof.memory_bytes == 400
