"""The torch call a node of a ``torch.onnx.export(dynamo=True)`` file came from.

The exporter records each node's FX node as text (``pkg.torch.onnx.fx_node``), e.g.
``%embedding : [...] = call_function[target=torch.ops.aten.embedding.default](args =
(%p_e_weight, %ids, 0), kwargs = {})``. Some arguments change what training computes
but not the exported forward, so the file's ops lose them: an embedding's
``padding_idx`` (no gradient for that row) and ``cross_entropy``'s
``label_smoothing`` (dropped by the exporter). :func:`aten_call` reads them back.
"""

from __future__ import annotations

import re

import onnx_ir as ir

FX_NODE_KEY = "pkg.torch.onnx.fx_node"
_CALL = re.compile(r"target=torch\.ops\.aten\.([\w.]+)\]\(args = \((.*)\), kwargs = \{")


def aten_call(node: ir.Node) -> tuple[str, list[str]] | None:
    """(aten overload, e.g. ``embedding.default``; its positional arguments as written)
    when the exporter recorded the call of ``node``; None otherwise."""
    text = node.metadata_props.get(FX_NODE_KEY)
    found = _CALL.search(text) if text else None
    if found is None:
        return None
    return found.group(1), _split_args(found.group(2))


def _split_args(text: str) -> list[str]:
    """``a, [b, c], (d, e)`` -> ``["a", "[b, c]", "(d, e)"]``."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    last = text[start:].strip()
    if last:
        out.append(last)
    return out


def int_arg(call: tuple[str, list[str]] | None, op: str, index: int) -> int | None:
    """Positional argument ``index`` of an ``op`` call as an int, when it is one."""
    return _arg(call, op, index, int)


def float_arg(call: tuple[str, list[str]] | None, op: str, index: int) -> float | None:
    """Positional argument ``index`` of an ``op`` call as a float, when it is one."""
    return _arg(call, op, index, float)


def _arg(call, op: str, index: int, kind):
    if call is None or call[0] != op or len(call[1]) <= index:
        return None
    try:
        return kind(call[1][index])
    except ValueError:
        return None
