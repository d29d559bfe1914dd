"""A parameter tied across blocks keeps its readers on one pipeline stage.

torch.onnx's optimizer folds equal initializers into one: in a freshly initialised
model every LayerNorm weight is all ones and every bias all zeros, so the export's
LayerNorms read one weight and one bias, tied across the layers. Compile refuses a
pipeline cut that puts one parameter's readers on two stages (its update would need
both stages' gradients), so the search cuts nowhere between a tied parameter's first
and last reader (``passes.stages.Segments.tied``): every pipelined point it offers
compiles, to the figures it was priced at. Here the first LayerNorm of layers 0 and 1
keep their initial values (tied), the other norms are perturbed (their own)."""

from __future__ import annotations

import json
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

from tensoropt.cli import build_parser, main  # noqa: E402
from tensoropt.cli.common import search_graph  # noqa: E402
from tensoropt.cli.search_json import load_search  # noqa: E402
from tensoropt.search.pipeline import segments_of  # noqa: E402
from tests.exports.models import CASES, GPT2  # noqa: E402

pytestmark = pytest.mark.slow

TIED = ("h.0.ln_1.", "h.1.ln_1.")


@pytest.fixture(scope="module")
def tied_gpt2(tmp_path_factory):
    torch.manual_seed(0)
    model = GPT2(layers=4).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and not name.startswith(TIED):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    inputs = CASES["gpt2"].inputs(torch.Generator().manual_seed(0))
    path = tmp_path_factory.mktemp("tied") / "gpt2.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (), str(path), kwargs=inputs, input_names=list(inputs), dynamo=True,
            external_data=False,
        )  # fmt: skip
    return path


def test_the_search_offers_no_pipeline_cut_between_a_tied_parameters_readers(
    tied_gpt2, tmp_path, capsys
):
    sg = search_graph(build_parser().parse_args(["search", str(tied_gpt2)]))
    segments = segments_of(sg)
    # layer 0's first LayerNorm is in segment 0, layer 1's in segment 2: no stage may
    # start at segment 1 or 2; later cuts are free
    assert sorted(segments.tied) == [1, 2] and segments.count > 4
    doc = tmp_path / "s.json"
    argv = ["search", str(tied_gpt2), "--devices", "4", "--axes", "split,micro,stages"]
    assert main([*argv, "--micro-batches", "2", "--json-out", str(doc)]) == 0
    capsys.readouterr()
    rows = load_search(str(doc)).rows(4)
    pipelined = [i for i, row in enumerate(rows) if row["axes"]["stages"] > 1]
    # (searched with every cut, a point of four stages started one at block_2)
    assert pipelined, "the cuts after layer 1 still pipeline"
    for index in pipelined:
        out = tmp_path / f"p{index}"
        code = main(["compile", str(tied_gpt2), "--search", str(doc), "--devices", "4",
                     "--pick", str(index), "-o", str(out), "--json"])  # fmt: skip
        captured = capsys.readouterr()
        assert code == 0, captured.err
        estimate = json.loads(captured.out)["estimate"]
        assert estimate["time_s"] == pytest.approx(rows[index]["time_s"], rel=1e-9)
        assert estimate["memory_bytes"] == pytest.approx(rows[index]["memory_bytes"], abs=1)
        starts = json.loads((out / "manifest.json").read_text())["pipeline"]["starts"]
        assert not {"block_1", "block_2"} & set(starts), starts


def test_a_hand_cut_between_a_tied_parameters_readers_is_refused(tied_gpt2, tmp_path, capsys):
    out = tmp_path / "o"
    # four even stages of the 9 blocks start at block_2, block_4 and block_7
    code = main(["compile", str(tied_gpt2), "--devices", "4", "--stages", "4",
                 "--micro-batches", "2", "-o", str(out)])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is read on pipeline stages [0, 1]" in err[0], err
    # what to do: even cuts are not the user's to move, so the line names the ways out
    assert "--axes split,micro,stages" in err[0] and "optimize=False" in err[0], err
    assert not out.exists()


def test_an_unoptimized_exports_tied_embedding_pipelines_like_one_device(
    exported, tmp_path, capsys
):
    """Without the exporter's optimizer the output layer reads the tied embedding through
    a ``Transpose`` of the parameter, beside the last block. The importer moves such a
    view of a shared parameter to the start (where it reties an optimized export's
    transposed copy), so the parameter is read in the first block only: the search may
    cut anywhere, and two even stages compile and train like one device. Left in place,
    the parameter was read on both stages and compile refused every even cut."""
    from tensoropt.ir.importer import import_model
    from tensoropt.runtime.run import run_steps

    path = exported("gpt2-noopt")
    out = tmp_path / "o"
    code = main(["compile", str(path), "--devices", "2", "--stages", "2",
                 "--micro-batches", "2", "-o", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    report = run_steps(out, 3, verify=True, threads=1).verify
    assert report is not None and report.ok, report.to_json()
    sg = search_graph(build_parser().parse_args(["search", str(path)]))
    assert not segments_of(sg).tied
    graph = import_model(str(path)).graph
    tied = [n for n in graph if n.op_type == "Transpose" and n.inputs[0].is_initializer()]
    tied = [n for n in tied if len({id(u.node) for u in n.inputs[0].uses()}) > 1]
    assert tied, "the export should read its tied embedding through a Transpose"
    assert graph.node(0) is tied[0]
