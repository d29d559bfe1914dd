"""Reference solver for checks: an Alpa-style integer program (HiGHS via highspy).

Not used by the product path (``solve``); tests and benchmarks compare the frontier
against it: for a memory budget, the ILP's minimum time must equal the fastest
frontier point within the budget. highspy is a development dependency.
"""

from __future__ import annotations

import numpy as np

from tensoropt.ir.costs import CostProblem


def ilp_min_time(problem: CostProblem, budget: float) -> tuple[tuple[int, ...], float]:
    """Alpa-style MILP: binary unit choices, continuous edge-pair variables tied to them."""
    import highspy

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("mip_abs_gap", 0.0)
    cost, mem, ucol = [], [], []
    for u in problem.units:
        ucol.append(len(cost))
        cost += [s.time_s for s in u.strategies]
        mem += [s.memory_bytes for s in u.strategies]
    n_unit_cols = len(cost)
    rows: list[tuple[list[int], list[float], float, float]] = [
        (list(range(ucol[i], ucol[i] + len(u.strategies))), [1.0] * len(u.strategies), 1.0, 1.0)
        for i, u in enumerate(problem.units)
    ]
    for e in problem.edges:
        base = len(cost)
        sa, sb = len(e.time_s), len(e.time_s[0])
        cost += [v for r in e.time_s for v in r]
        mem += [v for r in e.memory_bytes for v in r]
        for i in range(sa):
            idx = [base + i * sb + j for j in range(sb)] + [ucol[e.src] + i]
            rows.append((idx, [1.0] * sb + [-1.0], 0.0, 0.0))
        for j in range(sb):
            idx = [base + i * sb + j for i in range(sa)] + [ucol[e.dst] + j]
            rows.append((idx, [1.0] * sa + [-1.0], 0.0, 0.0))
    # Costs in seconds (~1e-6) and bytes (~1e9) sit at the solver's tolerances; scale
    # both to order one (the optimum is unchanged; the result is re-evaluated exactly).
    t_scale = 1.0 / max(max(cost), 1e-30)
    m_scale = 1.0 / max(budget, max(mem), 1e-30)
    rows.append((list(range(len(cost))), [v * m_scale for v in mem], -np.inf, budget * m_scale))
    n = len(cost)
    h.addCols(
        n,
        np.array(cost) * t_scale * 1e3,
        np.zeros(n),
        np.ones(n),
        0,
        np.zeros(0, np.int32),
        np.zeros(0, np.int32),
        np.zeros(0),
    )
    h.changeColsIntegrality(
        n_unit_cols, np.arange(n_unit_cols, dtype=np.int32), np.ones(n_unit_cols, dtype=np.uint8)
    )
    starts = np.cumsum([0] + [len(r[0]) for r in rows[:-1]]).astype(np.int32)
    h.addRows(
        len(rows),
        np.array([r[2] for r in rows]),
        np.array([r[3] for r in rows]),
        sum(len(r[0]) for r in rows),
        starts,
        np.array([i for r in rows for i in r[0]], dtype=np.int32),
        np.array([v for r in rows for v in r[1]]),
    )
    h.run()
    x = np.array(h.getSolution().col_value)
    choice = tuple(
        int(np.argmax(x[ucol[i] : ucol[i] + len(u.strategies)]))
        for i, u in enumerate(problem.units)
    )
    return choice, problem.evaluate(choice)[0]
