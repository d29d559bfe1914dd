"""``tensoropt model``: writes the file, prints one line, fails with exit 2 and one line."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import onnx
import pytest

from tensoropt.cli import main
from tensoropt.models import zoo_info


def test_cli_writes_model_and_reports_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "gpt.onnx"
    rc = main(["model", "gpt", "--layers", "3", "--seq", "16", "-o", str(path)])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    model = onnx.load(str(path))
    info = zoo_info(model)
    assert info is not None and info.name == "gpt" and info.preset == "tiny"
    assert f"{info.params:,} parameters" in out[0]
    assert str(path) in out[0]
    dims = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    assert dims == [8, 16, 64]
    assert sum(n.op_type == "LayerNormalization" for n in model.graph.node) == 7


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["model", "gpt", "--preset", "huge"], "unknown preset 'huge'"),
        (["model", "alexnet"], "unknown model 'alexnet'"),
        (["model", "vgg16", "--seq", "4"], "--seq does not apply"),
        (["model", "gpt", "--heads", "5"], "not divisible"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str], fragment: str
) -> None:
    path = tmp_path / "x.onnx"
    rc = main([*argv, "-o", str(path)])
    assert rc == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0]
    assert lines[0].startswith("tensoropt model: error:")
    assert not path.exists()


def test_cli_bad_output_directory_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["model", "mlp", "-o", str(tmp_path / "missing" / "m.onnx")])
    assert rc == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "does not exist" in lines[0]


def test_cli_paper_gpt_stays_small_in_memory(tmp_path: Path) -> None:
    """The 3 GiB GPT paper preset is written without ever holding its weights."""
    script = textwrap.dedent(
        """
        import sys
        from tensoropt.cli import main
        rc = main(["model", "gpt", "--preset", "paper", "-o", sys.argv[1]])
        # VmHWM is this process's own peak; ru_maxrss would include the parent's
        # high-water mark, which Linux carries across exec.
        hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
        print(rc, int(hwm.split()[1]))
        """
    )
    path = tmp_path / "gpt.onnx"
    proc = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True
    )
    last = proc.stdout.strip().splitlines()[-1].split()
    rc, max_rss_kib = int(last[0]), int(last[1])
    assert rc == 0
    assert max_rss_kib < 300 * 1024
    assert "zeros for planning" in proc.stdout
    assert os.stat(f"{path}.data").st_size > 3 * 2**30
