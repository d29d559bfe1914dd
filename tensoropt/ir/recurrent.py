"""LSTM, GRU and RNN nodes unrolled over their static sequence into primitive ops.

``torch.onnx.export`` emits one ``LSTM``/``GRU``/``RNN`` node per layer for ``nn.LSTM``,
``nn.GRU`` and ``nn.RNN``. No gradient or sharding rule reads a recurrence, so
:func:`unroll` spells each node out, step by step, in the ONNX definition's equations
and gate orders (LSTM ``iofc``, GRU ``zrh``):

- the input projection of every step at once, ``X W^T + Wb`` ([T, B, G*H]), read per
  step with a Gather; the recurrent projection ``H R^T + Rb`` per step;
- LSTM: ``i, f = f(..)`` (peepholes ``P`` times the previous cell), ``c~ = g(..)``,
  ``C = f C' + i c~``, ``o = f(.. + Po C)``, ``H = o h(C)``; GRU: ``z, r = f(..)``,
  ``h~ = g(Xh + r (H' Rh^T + Rbh) + Wbh)`` with ``linear_before_reset`` (how torch
  exports), ``g(Xh + (r H') Rh^T + Rbh + Wbh)`` without, ``H = (1 - z) h~ + z H'``;
  RNN: ``H = f(..)``;
- ``reverse`` runs the steps backwards,
  ``bidirectional`` both (the directions' outputs stacked on the direction axis);
  ``layout`` 1 (batch first) transposes in and out;
- the outputs ``Y`` [T, D, B, H] (layout 1: [B, T, D, H]), ``Y_h`` and ``Y_c``
  [D, B, H] (layout 1: [B, D, H]).

A ``sequence_lens`` input other than the full length everywhere, ``input_forget``,
``clip`` (onnxruntime's kernel does not clip where the definition's text says), or an
activation other than Sigmoid, Tanh and Relu is refused, naming the node (torch emits
none of them). Checked
against onnxruntime's kernels in ``tests/ir/test_recurrent.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from tensoropt.errors import UnsupportedOpError

RECURRENT = frozenset({"LSTM", "GRU", "RNN"})
_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
_DEFAULT_ACTIVATIONS = {
    "LSTM": ("Sigmoid", "Tanh", "Tanh"),
    "GRU": ("Sigmoid", "Tanh"),
    "RNN": ("Tanh",),
}
_ACTIVATIONS = frozenset({"Sigmoid", "Tanh", "Relu"})

# (op_type, inputs, shape, hint, attributes) -> the output value
Emit = Callable[..., ir.Value]


class _Recurrence:
    """One recurrent node: its weights, attributes and the builder's emitters."""

    def __init__(self, node: ir.Node, op: Emit, const: Callable, path: str) -> None:
        self.node, self.op, self.const, self.path = node, op, const, path
        self.kind = node.op_type
        ins = list(node.inputs) + [None] * (8 - len(node.inputs))
        self.x, self.w, self.r, self.bias, lens, self.h0 = ins[:6]
        self.c0, self.peep = (ins[6], ins[7]) if self.kind == "LSTM" else (None, None)
        attrs = node.attributes
        hidden = attrs.get_int("hidden_size", 0)
        self.hidden = hidden or None
        self.direction = attrs.get_string("direction", "forward")
        self.layout = attrs.get_int("layout", 0)
        self.before_reset = attrs.get_int("linear_before_reset", 0)
        self.dtype = self.x.dtype
        shape = [int(d) for d in self.x.shape]
        self.steps, self.batch = (shape[1], shape[0]) if self.layout else (shape[0], shape[1])
        self.dirs = 2 if self.direction == "bidirectional" else 1
        gates = _GATES[self.kind]
        acts = attrs.get_strings("activations", None)
        per = len(_DEFAULT_ACTIVATIONS[self.kind])
        self.activations = [
            tuple(acts[d * per : (d + 1) * per]) if acts else _DEFAULT_ACTIVATIONS[self.kind]
            for d in range(self.dirs)
        ]
        self._check(lens, gates)

    def refuse(self, why: str) -> UnsupportedOpError:
        return UnsupportedOpError(
            f"{self.path}: {self.kind} node {self.node.name!r}: {why}; export the recurrence "
            "without it, or unrolled (a loop over the steps in forward)"
        )

    def _check(self, lens: ir.Value | None, gates: int) -> None:
        if self.hidden is None or self.direction not in ("forward", "reverse", "bidirectional"):
            raise self.refuse("no hidden_size, or an unknown direction")
        if self.kind == "LSTM" and self.node.attributes.get_int("input_forget", 0):
            raise self.refuse("input_forget=1 (coupled input and forget gates)")
        if "activation_alpha" in self.node.attributes or "activation_beta" in self.node.attributes:
            raise self.refuse("activation_alpha/beta (parametrised activations)")
        if "clip" in self.node.attributes:  # where kernels clip differs (onnxruntime's did)
            raise self.refuse("clip (a cell clip threshold)")
        for acts in self.activations:
            bad = [a for a in acts if a not in _ACTIVATIONS]
            if bad:
                raise self.refuse(f"activation {bad[0]} (Sigmoid, Tanh and Relu unroll)")
        if lens is not None:
            full = lens.const_value is not None and bool(
                np.all(np.asarray(lens.const_value.numpy()) == self.steps)
            )
            if not full:
                raise self.refuse("sequence_lens shorter than the sequence, or not a constant")
        if [int(d) for d in self.w.shape][1] != gates * self.hidden:
            raise self.refuse("weights that are not [directions, gates * hidden, input]")

    # -- emission -------------------------------------------------------------------

    def _ints(self, values: list[int], hint: str) -> ir.Value:
        return self.const(np.asarray(values, dtype=np.int64), hint)

    def _pick(self, value: ir.Value, index: int, shape: list[int], hint: str, axis=0) -> ir.Value:
        """``value[index]`` along ``axis``."""
        at = self.const(np.asarray(index, dtype=np.int64), "index")
        return self.op("Gather", [value, at], shape, hint, axis=axis)

    def _slice(self, value, start: int, end: int, axis: int, shape, hint: str) -> ir.Value:
        """``value[start:end]`` along ``axis``."""
        bounds = [
            self._ints([start], "start"),
            self._ints([end], "end"),
            self._ints([axis], "axis"),
        ]
        return self.op("Slice", [value, *bounds], shape, hint)

    def _piece(self, value: ir.Value, k: int, rows: int | None, hint: str) -> ir.Value:
        """Gate ``k`` of the last dimension (``hidden`` wide) of a [rows, G*H] value (a
        [G*H] one when ``rows`` is None: a bias alone)."""
        h = self.hidden
        shape = [h] if rows is None else [rows, h]
        return self._slice(value, k * h, (k + 1) * h, -1, shape, hint)

    def _unsqueezed(self, value: ir.Value, axis: int, shape, hint: str) -> ir.Value:
        return self.op("Unsqueeze", [value, self._ints([axis], "axes")], shape, hint)

    def _stacked(self, values: list[ir.Value], axis: int, shape, hint: str) -> ir.Value:
        return values[0] if len(values) == 1 else self.op("Concat", values, shape, hint, axis=axis)

    def _act(self, name: str, value: ir.Value, hint: str) -> ir.Value:
        return self.op(name, [value], self._bh, hint)

    @property
    def _np(self) -> np.dtype:
        return np.dtype(self.dtype.numpy())

    @property
    def _bh(self) -> list[int]:
        return [self.batch, self.hidden]

    def _bias_halves(self, d: int) -> tuple[ir.Value | None, ir.Value | None]:
        """(Wb, Rb) of direction ``d``, each [G*H]."""
        if self.bias is None:
            return None, None
        gh = _GATES[self.kind] * self.hidden
        both = self._pick(self.bias, d, [2 * gh], "bias")
        wb = self._slice(both, 0, gh, 0, [gh], "input_bias")
        rb = self._slice(both, gh, 2 * gh, 0, [gh], "recurrent_bias")
        return wb, rb

    def _initial(self, value: ir.Value | None, d: int, hint: str) -> ir.Value | None:
        """Direction ``d``'s initial state, or None when it is zero (absent, or a constant
        of zeros, as torch exports ``nn.LSTM``'s default state)."""
        tensor = None if value is None else value.const_value
        if value is None or (tensor is not None and not np.any(tensor.numpy())):
            return None
        return self._pick(value, d, self._bh, hint, axis=self.layout)  # [B, D, H] batch first

    def run(self) -> tuple[ir.Value, ir.Value, ir.Value | None]:
        """(Y, Y_h, Y_c) of the node."""
        t_, b_, h_ = self.steps, self.batch, self.hidden
        xs = self.x
        if self.layout:
            shape = [t_, b_, int(self.x.shape[2])]
            xs = self.op("Transpose", [self.x], shape, "time_major", perm=[1, 0, 2])
        ys, last_h, last_c = [], [], []
        for d in range(self.dirs):
            y, h, c = self._direction(d, xs)
            ys.append(self._unsqueezed(y, 1, [t_, 1, b_, h_], "y"))
            last_h.append(self._unsqueezed(h, 0, [1, b_, h_], "y_h"))
            if c is not None:
                last_c.append(self._unsqueezed(c, 0, [1, b_, h_], "y_c"))
        dirs = self.dirs
        y = self._stacked(ys, 1, [t_, dirs, b_, h_], "y_dirs")
        yh = self._stacked(last_h, 0, [dirs, b_, h_], "y_h_dirs")
        yc = self._stacked(last_c, 0, [dirs, b_, h_], "y_c_dirs") if last_c else None
        if self.layout:
            y = self.op("Transpose", [y], [b_, t_, dirs, h_], "y_batch_first", perm=[2, 0, 1, 3])
            yh = self.op("Transpose", [yh], [b_, dirs, h_], "y_h_batch_first", perm=[1, 0, 2])
            if yc is not None:
                yc = self.op("Transpose", [yc], [b_, dirs, h_], "y_c_batch_first", perm=[1, 0, 2])
        return y, yh, yc

    def _direction(self, d: int, xs: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value | None]:
        """(Y [T, B, H], last H, last C) of direction ``d`` over the time-major ``xs``."""
        t_, b_, h_ = self.steps, self.batch, self.hidden
        gh = _GATES[self.kind] * h_
        inputs = int(xs.shape[-1])
        w = self._pick(self.w, d, [gh, inputs], "input_weight")
        r = self._pick(self.r, d, [gh, h_], "recurrent_weight")
        wt = self.op("Transpose", [w], [inputs, gh], "input_weight_t", perm=[1, 0])
        rt = self.op("Transpose", [r], [h_, gh], "recurrent_weight_t", perm=[1, 0])
        wb, rb = self._bias_halves(d)
        xw = self.op("MatMul", [xs, wt], [t_, b_, gh], "input_projection")
        if wb is not None:
            xw = self.op("Add", [xw, wb], [t_, b_, gh], "input_projection_bias")
        h = self._initial(self.h0, d, "initial_h")
        c = self._initial(self.c0, d, "initial_c") if self.kind == "LSTM" else None
        peep = None
        if self.kind == "LSTM" and self.peep is not None:
            peep = self._pick(self.peep, d, [3 * h_], "peepholes")
        backwards = self.direction == "reverse" or d == 1
        outs: dict[int, ir.Value] = {}
        for t in range(t_ - 1, -1, -1) if backwards else range(t_):
            x_t = self._pick(xw, t, [b_, gh], f"step{t}_input")
            h, c = self._step(d, x_t, h, c, rt, rb, peep, t)
            outs[t] = self._unsqueezed(h, 0, [1, b_, h_], f"step{t}_h")
        y = self.op("Concat", [outs[t] for t in range(t_)], [t_, b_, h_], "outputs", axis=0)
        return y, h, c

    def _step(self, d, x_t, h, c, rt, rb, peep, t):
        """One step: (H, C) after ``x_t`` from (``h``, ``c``); ``h`` and ``c`` are None
        for a zero state (the first step of a zero initial state: nothing of batch size
        is made that the batch split could not hold)."""
        b_ = self.batch
        gh = _GATES[self.kind] * self.hidden
        f, g, *rest = self.activations[d] + ("",)
        tag = f"step{t}"
        if self.kind == "GRU" and not self.before_reset:
            return self._gru_after_reset(d, x_t, h, rt, rb, tag), None
        hr = None if h is None else self.op("MatMul", [h, rt], [b_, gh], f"{tag}_recurrent")
        if rb is not None:
            hr = rb if hr is None else self.op("Add", [hr, rb], [b_, gh], f"{tag}_recurrent_bias")
        total = x_t if hr is None else self.op("Add", [x_t, hr], [b_, gh], f"{tag}_sum")
        if self.kind == "RNN":
            return self._act(f, total, f"{tag}_h"), None
        if self.kind == "GRU":
            z = self._act(f, self._piece(total, 0, b_, f"{tag}_z_in"), f"{tag}_z")
            r = self._act(f, self._piece(total, 1, b_, f"{tag}_r_in"), f"{tag}_r")
            cand_in = self._piece(x_t, 2, b_, f"{tag}_xh")
            if hr is not None:  # a bias alone ([3H]) from a zero state
                hh = self._piece(hr, 2, None if h is None else b_, f"{tag}_hh")
                reset = self.op("Mul", [r, hh], self._bh, f"{tag}_reset")
                cand_in = self.op("Add", [cand_in, reset], self._bh, f"{tag}_cand_in")
            return self._blend(z, self._act(g, cand_in, f"{tag}_cand"), h, tag), None
        i_in, o_in, f_in, c_in = (
            self._piece(total, k, b_, f"{tag}_{n}_in") for k, n in enumerate("iofc")
        )
        if peep is not None and c is not None:
            i_in = self._peep(i_in, peep, 0, c, f"{tag}_i_peep")
            f_in = self._peep(f_in, peep, 2, c, f"{tag}_f_peep")
        i_gate = self._act(f, i_in, f"{tag}_i")
        cell = self.op("Mul", [i_gate, self._act(g, c_in, f"{tag}_c")], self._bh, f"{tag}_fresh")
        if c is not None:
            f_gate = self._act(f, f_in, f"{tag}_f")
            kept = self.op("Mul", [f_gate, c], self._bh, f"{tag}_kept")
            cell = self.op("Add", [kept, cell], self._bh, f"{tag}_cell")
        if peep is not None:
            o_in = self._peep(o_in, peep, 1, cell, f"{tag}_o_peep")
        o_gate = self._act(f, o_in, f"{tag}_o")
        squashed = self._act(rest[0], cell, f"{tag}_cell_act")
        return self.op("Mul", [o_gate, squashed], self._bh, f"{tag}_h"), cell

    def _peep(self, value, peep, k, cell, hint):
        h_ = self.hidden
        p = self._slice(peep, k * h_, (k + 1) * h_, 0, [h_], f"{hint}_weight")
        scaled = self.op("Mul", [p, cell], self._bh, f"{hint}_scaled")
        return self.op("Add", [value, scaled], self._bh, hint)

    def _blend(self, z, cand, h, tag):
        """``(1 - z) h~ + z H'`` (``h`` None: a zero state)."""
        one = self.const(np.asarray(1.0, dtype=self._np), "one")
        keep = self.op("Sub", [one, z], self._bh, f"{tag}_update")
        new = self.op("Mul", [keep, cand], self._bh, f"{tag}_new")
        if h is None:
            return new
        old = self.op("Mul", [z, h], self._bh, f"{tag}_old")
        return self.op("Add", [new, old], self._bh, f"{tag}_h")

    def _gru_after_reset(self, d, x_t, h, rt, rb, tag):
        """GRU with ``linear_before_reset=0``: the reset gate scales H' before Rh."""
        b_, h_ = self.batch, self.hidden
        f, g = self.activations[d][:2]
        hr = None
        if h is not None:
            zr_t = self._slice(rt, 0, 2 * h_, 1, [h_, 2 * h_], f"{tag}_zr_weight")
            hr = self.op("MatMul", [h, zr_t], [b_, 2 * h_], f"{tag}_recurrent")
        if rb is not None:
            rzr = self._slice(rb, 0, 2 * h_, 0, [2 * h_], f"{tag}_zr_bias")
            hr = rzr if hr is None else self.op("Add", [hr, rzr], [b_, 2 * h_], f"{tag}_zr_sum")
        pieces = [self._piece(x_t, k, b_, f"{tag}_x{n}") for k, n in enumerate("zr")]
        if hr is not None:  # a bias alone ([2H]) from a zero state
            rows = None if h is None else b_
            pieces = [
                self.op(
                    "Add", [p, self._piece(hr, k, rows, f"{tag}_h{n}")], self._bh, f"{tag}_{n}_in"
                )
                for k, (p, n) in enumerate(zip(pieces, "zr", strict=True))
            ]
        z = self._act(f, pieces[0], f"{tag}_z")
        r = self._act(f, pieces[1], f"{tag}_r")
        cand_in = self._piece(x_t, 2, b_, f"{tag}_xh")
        hh = None
        if h is not None:
            h_t = self._slice(rt, 2 * h_, 3 * h_, 1, [h_, h_], f"{tag}_h_weight")
            reset = self.op("Mul", [r, h], self._bh, f"{tag}_reset")
            hh = self.op("MatMul", [reset, h_t], self._bh, f"{tag}_hh")
        if rb is not None:
            rbh = self._slice(rb, 2 * h_, 3 * h_, 0, [h_], f"{tag}_h_bias")
            hh = rbh if hh is None else self.op("Add", [hh, rbh], self._bh, f"{tag}_hh_bias")
        if hh is not None:
            cand_in = self.op("Add", [cand_in, hh], self._bh, f"{tag}_cand_in")
        return self._blend(z, self._act(g, cand_in, f"{tag}_cand"), h, tag)


def unroll(node: ir.Node, op: Emit, const: Callable, path: str) -> list[ir.Value | None]:
    """The node's outputs (Y, Y_h, Y_c) spelled out with ``op`` and ``const`` (the
    canonical builder's emitters), one per output the node has."""
    y, yh, yc = _Recurrence(node, op, const, path).run()
    return [y, yh, yc][: len(node.outputs)]
