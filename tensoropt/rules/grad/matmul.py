"""Gradient rules of contractions: MatMul (N-D, broadcasting, 1-D operands), Gemm
and Einsum (explicit two-or-more-operand equations).

MatMul against a 2-D weight (the linear layer) folds the batch dimensions of
the activation into rows before the weight gradient, so the weight gradient is
one 2-D MatMul rather than a batched product followed by a sum. The batch dimension
leads the rows: a seq-first activation ``[T, B, C]`` is transposed to ``[B, T, C]``
first, so a split of the batch stays one contiguous block of rows (folded as
``[T * B, C]`` it would be a strided piece no layout holds, and a data-parallel or
micro-batched plan would gather the whole batch there).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from tensoropt.rules.grad._common import broadcast_shape, unbroadcast, unsupported
from tensoropt.rules.grad.api import GradContext, GradRegistry, GradRule

Grads = list[ir.Value | None]


def _swap_last(b, x: ir.Value, rank: int) -> ir.Value:
    perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    return b.op("Transpose", [x], {"perm": perm})


def _reshape(b, x: ir.Value, shape: Sequence[int]) -> ir.Value:
    return b.op("Reshape", [x, b.ints(list(shape))])


def _matmul(ctx: GradContext) -> Grads:
    b, g = ctx.b, ctx.grad_outputs[0]
    a, w = ctx.inputs[0], ctx.inputs[1]
    a_shape, w_shape = ctx.shape(0), ctx.shape(1)
    # Promote 1-D operands to matrices, as MatMul does.
    a2_shape = (1, *a_shape) if len(a_shape) == 1 else a_shape
    w2_shape = (*w_shape, 1) if len(w_shape) == 1 else w_shape
    a2 = _reshape(b, a, a2_shape) if len(a_shape) == 1 else a
    w2 = _reshape(b, w, w2_shape) if len(w_shape) == 1 else w
    batch = broadcast_shape(a2_shape[:-2], w2_shape[:-2])
    out2_shape = (*batch, a2_shape[-2], w2_shape[-1])
    g2 = g if len(a_shape) > 1 and len(w_shape) > 1 else _reshape(b, g, out2_shape)
    ga = gw = None
    if ctx.needs[0]:
        da = b.op("MatMul", [g2, _swap_last(b, w2, len(w2_shape))])
        da_shape = (*batch, a2_shape[-2], a2_shape[-1])
        da = unbroadcast(b, da, da_shape, a2_shape)
        ga = _reshape(b, da, a_shape) if len(a_shape) == 1 else da
    if ctx.needs[1]:
        if len(w2_shape) == 2 and len(a2_shape) > 2:
            # Linear layer: fold batch dims into rows, one 2-D MatMul.
            rows = int(np.prod(a2_shape[:-1]))
            lead = ctx.batch_dim(0)
            if lead is not None and 0 < lead < len(a2_shape) - 1:
                order = [lead, *(d for d in range(len(a2_shape)) if d != lead)]
                a2 = b.op("Transpose", [a2], {"perm": order})
                g2 = b.op("Transpose", [g2], {"perm": order})
            a_flat = _reshape(b, a2, (rows, a2_shape[-1]))
            g_flat = _reshape(b, g2, (rows, w2_shape[-1]))
            dw = b.op("MatMul", [b.op("Transpose", [a_flat], {"perm": [1, 0]}), g_flat])
        else:
            dw = b.op("MatMul", [_swap_last(b, a2, len(a2_shape)), g2])
            dw = unbroadcast(b, dw, (*batch, w2_shape[-2], w2_shape[-1]), w2_shape)
        gw = _reshape(b, dw, w_shape) if len(w_shape) == 1 else dw
    return [ga, gw]


def _gemm(ctx: GradContext) -> Grads:
    """Y = alpha op(A) op(B) + beta C, each gradient one Gemm with the right transposes."""
    b, g = ctx.b, ctx.grad_outputs[0]
    a, w = ctx.inputs[0], ctx.inputs[1]
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))
    ta, tb = int(ctx.attr("transA", 0)), int(ctx.attr("transB", 0))
    grads: Grads = [None] * len(ctx.inputs)
    if ctx.needs[0]:
        if ta:  # dA = alpha op(B) g^T
            grads[0] = b.op("Gemm", [w, g], {"alpha": alpha, "transA": tb, "transB": 1})
        else:  # dA = alpha g op(B)^T
            grads[0] = b.op("Gemm", [g, w], {"alpha": alpha, "transB": 1 - tb})
    if ctx.needs[1]:
        if tb:  # dB = alpha g^T op(A)
            grads[1] = b.op("Gemm", [g, a], {"alpha": alpha, "transA": 1, "transB": ta})
        else:  # dB = alpha op(A)^T g
            grads[1] = b.op("Gemm", [a, g], {"alpha": alpha, "transA": 1 - ta})
    if len(ctx.inputs) > 2 and ctx.needs[2]:
        gc = g if beta == 1.0 else b.op("Mul", [g, b.scalar_like(beta, ctx.outputs[0])])
        grads[2] = unbroadcast(b, gc, ctx.out_shape(), ctx.shape(2))
    return grads


def _parse_einsum(ctx: GradContext) -> tuple[list[str], str]:
    equation = str(ctx.attr("equation", "")).replace(" ", "")
    if "->" not in equation or "." in equation:
        raise unsupported(ctx, f"einsum equation {equation!r} (implicit output or ellipsis)")
    lhs, out = equation.split("->")
    terms = lhs.split(",")
    if any(len(set(t)) != len(t) for t in [*terms, out]):
        raise unsupported(ctx, f"einsum equation {equation!r} (repeated index in one operand)")
    return terms, out


def _einsum(ctx: GradContext) -> Grads:
    """d operand_i = Einsum(g, other operands -> term_i), then broadcast over the
    indices that appear only in term_i (they were summed out on their own)."""
    b, g = ctx.b, ctx.grad_outputs[0]
    terms, out = _parse_einsum(ctx)
    grads: Grads = [None] * len(terms)
    for i, term in enumerate(terms):
        if not ctx.needs[i]:
            continue
        others = [t for j, t in enumerate(terms) if j != i]
        seen = set(out).union(*others)
        kept = "".join(c for c in term if c in seen)
        eq = ",".join([out, *others]) + "->" + kept
        ops = [g] + [v for j, v in enumerate(ctx.inputs) if j != i]
        grad = b.op("Einsum", ops, {"equation": eq})
        if kept != term:
            shape = ctx.shape(i)
            lonely = [k for k, c in enumerate(term) if c not in seen]
            grad = b.op("Unsqueeze", [grad, b.ints(lonely)])
            grad = b.op("Expand", [grad, b.ints(list(shape))])
        grads[i] = grad
    return grads


_RULES: tuple[tuple[str, GradRule], ...] = (
    ("MatMul", _matmul),
    ("Gemm", _gemm),
    ("Einsum", _einsum),
)


def register_into(registry: GradRegistry) -> None:
    """Add this family's rules to ``registry``."""
    for op_type, rule in _RULES:
        registry.register(op_type)(rule)
