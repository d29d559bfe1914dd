"""One ``--json`` convention for every command: ``--json`` prints one JSON document on
stdout and nothing else; ``--json-out FILE`` writes it where a file is natural; every
document has a ``schema`` and integer byte counts."""

from __future__ import annotations

import json
import os

import pytest

from tests.cli.cli_run import Outcome, cli, cli_process

pytest.importorskip("matplotlib")


def byte_counts(obj: object, key: str = "") -> list[tuple[str, object]]:
    """Every (key, value) whose key ends in ``bytes``, at any depth."""
    found = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if str(k).endswith("bytes") and not isinstance(v, (dict, list)):
                found.append((str(k), v))
            found += byte_counts(v, str(k))
    elif isinstance(obj, list):
        for v in obj:
            found += byte_counts(v, key)
    return found


def json_of(outcome: Outcome, command: str) -> dict:
    """Exit 0, stdout is exactly one JSON document with the command's schema and integer
    byte counts (``json.loads`` refuses any other text around it)."""
    assert outcome.code == 0, outcome.err
    doc = json.loads(outcome.out)
    assert doc["schema"].startswith(f"tensoropt.{command}/"), doc["schema"]
    counts = byte_counts(doc)
    bad = [(k, v) for k, v in counts if v is not None and type(v) is not int]
    assert not bad, bad
    return doc


@pytest.fixture(scope="module")
def compiled(zoo_file, tmp_path_factory):
    """The tiny MLP compiled data-parallel on 2 devices, and its compile --json."""
    from tensoropt.cli import main

    out = tmp_path_factory.mktemp("dp2") / "out"
    argv = ["compile", str(zoo_file("mlp")), "--devices", "2", "--plan", "data-parallel"]
    capture = _Capture()
    with capture:
        code = main([*argv, "-o", str(out), "--json"])
    assert code == 0
    return out, capture.text


class _Capture:
    """stdout of a call made outside a test's capsys (module fixtures)."""

    def __enter__(self):
        import contextlib
        import io

        self._buffer = io.StringIO()
        self._redirect = contextlib.redirect_stdout(self._buffer)
        self._redirect.__enter__()
        return self

    def __exit__(self, *exc):
        self._redirect.__exit__(*exc)
        self.text = self._buffer.getvalue()


def test_model_json(tmp_path, capsys):
    path = tmp_path / "gpt.onnx"
    doc = json_of(cli(capsys, "model", "gpt", "-o", path, "--json"), "model")
    assert doc["path"] == str(path) and path.exists()
    assert doc["model"] == "gpt" and doc["parameters"] > 0 and doc["weight_bytes"] > 0


def test_train_json(zoo_file, capsys):
    doc = json_of(cli(capsys, "train", zoo_file("mlp"), "--steps", 2, "--json"), "train")
    assert len(doc["losses"]) == 2


def test_search_json_on_stdout_is_the_json_out_file(zoo_file, tmp_path, capsys):
    path = tmp_path / "s.json"
    outcome = cli(
        capsys, "search", zoo_file("mlp"), "--devices", "1,2", "--json", "--json-out", path
    )
    doc = json_of(outcome, "search")
    assert json.loads(path.read_text()) == doc
    assert set(doc["per_device"]) == {"1", "2"}
    assert doc["memory_budget_bytes"] is None and doc["cluster"]["name"] == "h100"
    # --json-out alone: the tables stay on stdout, the file is the same document
    tables = cli(capsys, "search", zoo_file("mlp"), "--devices", "1,2", "--json-out", path)
    assert tables.code == 0 and "frontier points" in tables.out
    assert json.loads(path.read_text()) == doc


def test_search_json_takes_no_path(zoo_file, tmp_path, monkeypatch):
    """``--json`` is a flag everywhere: the old ``search --json FILE`` is refused, and
    ``--json -`` writes no file named ``-``."""
    monkeypatch.chdir(tmp_path)
    for value in ("s.json", "-"):
        outcome = cli_process("search", zoo_file("mlp"), "--devices", "1", "--json", value)
        assert outcome.code == 2 and outcome.out == ""
        assert "Traceback" not in outcome.err
        assert not (tmp_path / value).exists()


def test_compile_json_gives_estimate_and_every_file(compiled):
    out, text = compiled
    doc = json_of(Outcome(0, text, ""), "compile")
    assert doc["outdir"] == str(out.resolve())
    assert sorted(doc["files"]) == sorted(str(out.resolve() / n) for n in os.listdir(out))
    assert doc["mesh"] == [2] and doc["world_size"] == 2
    assert doc["plan_source"]
    estimate = doc["estimate"]
    assert estimate["time_s"] > 0 and estimate["memory_bytes"] > 0
    assert estimate["collectives_per_device"] >= 1 and estimate["cluster"] == "h100"
    assert doc["collectives_per_device"] >= 1 and doc["replicates_all_work"] is False


def test_replicated_plan_says_no_faster_than_one_device(zoo_file, tmp_path, capsys):
    plan = tmp_path / "replicated.json"
    plan.write_text(
        json.dumps(
            {
                "schema": "tensoropt.plan/1",
                "source": "test: every device computes everything",
                "mesh": {"shape": [2], "axis_names": ["dp"]},
                "default": "replicated",
                "units": {},
            }
        )
    )
    argv = ["compile", zoo_file("mlp"), "--devices", 2, "--plan", plan]
    text = cli(capsys, *argv, "-o", tmp_path / "a")
    assert text.code == 0, text.err
    assert "0 collectives per device" in text.out and "no faster than 1 device" in text.out
    doc = json_of(cli(capsys, *argv, "-o", tmp_path / "b", "--json"), "compile")
    assert doc["replicates_all_work"] is True and doc["collectives_per_device"] == 0
    assert "data-parallel" not in text.out + text.err
    inspected = cli(capsys, "inspect", tmp_path / "a")
    assert inspected.code == 0 and "no faster than 1 device" in inspected.out
    inspected = json_of(cli(capsys, "inspect", tmp_path / "a", "--json"), "inspect")
    assert inspected["replicates_all_work"] is True


def test_run_json(compiled, capsys):
    out, _ = compiled
    doc = json_of(cli(capsys, "run", out, "--steps", 2, "--verify", "--json"), "run")
    assert doc["world_size"] == 2 and len(doc["losses"]) == 2
    assert doc["verify"]["ok"] is True


def test_inspect_json_gives_mesh_plan_source_and_estimate(compiled, capsys):
    out, text = compiled
    compiled_doc = json.loads(text)
    doc = json_of(cli(capsys, "inspect", out, "--json"), "inspect")
    assert doc["mesh"]["shape"] == [2]
    assert doc["plan_source"] == compiled_doc["plan_source"]
    assert doc["estimate"] == compiled_doc["estimate"]
    assert [d["file"] for d in doc["devices"]] == ["device_0.onnx", "device_1.onnx"]
    assert doc["replicates_all_work"] is False
    single = json_of(cli(capsys, "inspect", out / "device_1.onnx", "--json"), "inspect")
    assert single["mesh"] is single["plan_source"] is single["estimate"] is None
    assert single["devices"] == doc["devices"][1:]


@pytest.mark.slow
def test_report_json(zoo_file, tmp_path, capsys):
    out = tmp_path / "report"
    argv = ["report", zoo_file("mlp"), "--devices", "1,2", "-o", out, "--json"]
    doc = json_of(cli(capsys, *argv), "report")
    assert doc["report"] == str(out / "report.md")
    assert all(os.path.isfile(f) for f in doc["files"]) and len(doc["files"]) >= 2


def test_integral_bytes_rounds_only_byte_counts():
    from tensoropt.cli.json_output import integral_bytes

    data = {"memory_bytes": 3.6, "time_s": 3.6, "rows": [{"bytes": 2.0, "n": 2.5}]}
    assert integral_bytes(data) == {
        "memory_bytes": 4,
        "time_s": 3.6,
        "rows": [{"bytes": 2, "n": 2.5}],
    }
    assert type(integral_bytes({"peak_bytes": 7.0})["peak_bytes"]) is int
