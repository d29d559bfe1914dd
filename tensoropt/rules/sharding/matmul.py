"""Contractions: MatMul (``b m k, b k n -> b m n`` with broadcast batch dims and 1-D
operands), Gemm (transposes; bias ``C`` must be ``P`` when ``k`` is sharded) and Einsum
(any equation, with ``...``; a label repeated inside one operand is never sharded).

A sharded contracting factor gives ``P`` outputs. Each op is linear in each float operand
separately, so one ``P`` operand with the others ``R`` gives a ``P`` output (Gemm: ``A`` or
``B`` together with a ``P`` bias).
"""

from __future__ import annotations

from tensoropt.errors import ShardingError
from tensoropt.rules.sharding.base import (
    FactorRule,
    FactorSpec,
    Labels,
    OpView,
    Reduction,
    ShardingRule,
    partial_strategy,
)

SUM = {"k": Reduction.SUM}


def _batch_labels(shape: tuple[int, ...], out_batch: tuple[int, ...]) -> Labels:
    """Right-aligned broadcast labels ``b0..`` for an operand's leading (batch) dims."""
    offset = len(out_batch) - len(shape)
    return tuple(
        f"b{j + offset}" if size == out_batch[j + offset] and size != 1 else None
        for j, size in enumerate(shape)
    )


def _matmul_spec(op: OpView) -> FactorSpec:
    a, b = op.input_shapes[0] or (), op.input_shapes[1] or ()
    out = op.output_shapes[0]
    nbatch = len(out) - (len(a) > 1) - (len(b) > 1)
    out_batch = out[:nbatch]
    la: Labels = ("k",) if len(a) == 1 else _batch_labels(a[:-2], out_batch) + ("m", "k")
    lb: Labels = ("k",) if len(b) == 1 else _batch_labels(b[:-2], out_batch) + ("k", "n")
    lo = tuple(f"b{j}" if size != 1 else None for j, size in enumerate(out_batch))
    lo += ("m",) if len(a) > 1 else ()
    lo += ("n",) if len(b) > 1 else ()
    partial = (partial_strategy(op, (0,)), partial_strategy(op, (1,)))
    return FactorSpec((la, lb), (lo,), reduce=SUM, partial=partial)


def _gemm_spec(op: OpView) -> FactorSpec:
    la: Labels = ("k", "m") if op.attr("transA", 0) else ("m", "k")
    lb: Labels = ("n", "k") if op.attr("transB", 0) else ("k", "n")
    m, n = op.output_shapes[0]
    ins: list[Labels | None] = [la, lb]
    has_c = op.has_input(2)
    if has_c:
        c = op.input_shapes[2] or ()
        full = (("m", m), ("n", n))[2 - len(c) :]
        ins.append(
            tuple(
                lab if size == dim and dim != 1 else None
                for (lab, dim), size in zip(full, c, strict=True)
            )
        )
    elif len(op.input_shapes) > 2:
        ins.append(None)
    bias = (2,) if has_c else ()
    partial = (partial_strategy(op, (0, *bias)), partial_strategy(op, (1, *bias)))
    return FactorSpec(
        tuple(ins), (("m", "n"),), reduce=SUM, additive=frozenset(bias), partial=partial
    )


def _parse_einsum(equation: str, ranks: list[int]) -> tuple[list[str], str]:
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise ShardingError(
            f"Einsum: equation {equation!r} has {len(terms)} operands, node has {len(ranks)}"
        )
    if not arrow:
        letters = "".join(terms).replace("...", "")
        rhs = ("..." if "..." in lhs else "") + "".join(
            sorted(c for c in set(letters) if letters.count(c) == 1)
        )
    return terms, rhs


def _expand_ellipsis(term: str, rank: int, ell: int) -> list[str]:
    """Operand term -> one label per dim; ``...`` becomes ``e<j>`` right-aligned to ``ell``."""
    if "..." not in term:
        return list(term)
    head, tail = term.split("...")
    n = rank - len(head) - len(tail)
    return list(head) + [f"e{ell - n + j}" for j in range(n)] + list(tail)


def _einsum_spec(op: OpView) -> FactorSpec:
    shapes = [s or () for s in op.input_shapes]
    terms, rhs = _parse_einsum(str(op.attr("equation", "")), [len(s) for s in shapes])
    ell = max(
        (
            len(s) - len(t.replace("...", ""))
            for s, t in zip(shapes, terms, strict=True)
            if "..." in t
        ),
        default=0,
    )
    per_operand = [_expand_ellipsis(t, len(s), ell) for s, t in zip(shapes, terms, strict=True)]
    out_labels = _expand_ellipsis(rhs, len(op.output_shapes[0]), ell)
    sizes = dict(zip(out_labels, op.output_shapes[0], strict=True))
    # A label repeated inside one operand (a diagonal) would need two dims on one mesh axis.
    blocked = {lab for labels in per_operand for lab in labels if labels.count(lab) > 1}
    blocked |= {lab for lab, size in sizes.items() if size == 1}

    def keep(lab: str, size: int) -> str | None:
        if lab in blocked or (lab in sizes and sizes[lab] != size):
            return None  # blocked, or an ellipsis dim broadcast from size 1
        return lab

    ins = tuple(
        tuple(keep(lab, size) for lab, size in zip(labels, shape, strict=True))
        for labels, shape in zip(per_operand, shapes, strict=True)
    )
    out = tuple(keep(lab, sizes[lab]) for lab in out_labels)
    reduce = {lab: Reduction.SUM for labels in ins for lab in labels if lab and lab not in sizes}
    partial = tuple(partial_strategy(op, (i,)) for i in range(len(shapes)))
    return FactorSpec(ins, (out,), reduce=reduce, partial=partial)


RULES: dict[str, ShardingRule] = {
    "MatMul": FactorRule(_matmul_spec),
    "Gemm": FactorRule(_gemm_spec),
    "Einsum": FactorRule(_einsum_spec),
}
