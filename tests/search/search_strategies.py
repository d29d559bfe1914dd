"""Hypothesis strategies for random cost problems whose sums are exact in float64.

Every cost is a small integer divided by 4 or 8 (a dyadic rational), so any order of
summation gives the same float: the search and the brute force can be compared with ==.
"""

from __future__ import annotations

from hypothesis import strategies as st

from tensoropt.ir.costs import CostProblem, Edge, Strategy, Unit


def values(result) -> list[tuple[float, float]]:
    return [(p.time_s, p.memory_bytes) for p in result.points]


def assert_choices_exact(problem: CostProblem, result) -> None:
    for p in result.points:
        assert problem.evaluate(p.choice) == (p.time_s, p.memory_bytes)


COST = st.integers(0, 24).map(lambda k: k / 4)
MEM = st.integers(0, 24).map(lambda k: k / 8)


@st.composite
def tables(draw, rows: int, cols: int):
    t = tuple(tuple(draw(COST) for _ in range(cols)) for _ in range(rows))
    m = tuple(tuple(draw(MEM) for _ in range(cols)) for _ in range(rows))
    return t, m


@st.composite
def units(draw, n: int, max_strategies: int = 4):
    out = []
    for i in range(n):
        k = draw(st.integers(1, max_strategies))
        out.append(Unit(f"u{i}", tuple(Strategy(f"s{j}", draw(COST), draw(MEM)) for j in range(k))))
    return tuple(out)


@st.composite
def problems(draw, max_units: int = 7, max_strategies: int = 4):
    """Random graphs: sparse, dense, cycles, parallel edges, self-loops, both directions."""
    n = draw(st.integers(1, max_units))
    us = draw(units(n, max_strategies))
    shape = draw(st.sampled_from(["sparse", "chain", "cycle", "dense"]))
    pairs: list[tuple[int, int]] = []
    if shape == "chain":
        pairs = [(i, i + 1) for i in range(n - 1)]
    elif shape == "cycle":
        pairs = [(i, (i + 1) % n) for i in range(n)]
    elif shape == "dense":
        pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    extra = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=6))
    edges = []
    for a, b in pairs + extra:
        if draw(st.booleans()):
            a, b = b, a
        t, m = draw(tables(len(us[a].strategies), len(us[b].strategies)))
        edges.append(Edge(a, b, t, m))
    return CostProblem(us, tuple(edges), devices=1, mesh=(1,))


@st.composite
def block_chains(draw, max_units: int = 8):
    """A prefix, `count` identical blocks chained by identical cross edges, a suffix.

    Returns (problem, (first_unit, units_per_block, count)).
    """
    size = draw(st.integers(1, 2))
    count = draw(st.integers(3, 4 if size == 2 else 6))
    pre = draw(st.integers(0, 1))
    post = draw(st.integers(0, 1))
    while pre + size * count + post > max_units:
        count -= 1
    block = draw(units(size, 3))
    inner = [(i, j) for i in range(size) for j in range(i + 1, size) if draw(st.booleans())]
    cross = draw(
        st.lists(
            st.tuples(st.integers(0, size - 1), st.integers(0, size - 1)),
            min_size=1,
            max_size=3,
            unique=True,
        )
    )
    dims = [len(u.strategies) for u in block]
    inner_t = {e: draw(tables(dims[e[0]], dims[e[1]])) for e in inner}
    cross_t = {e: draw(tables(dims[e[0]], dims[e[1]])) for e in cross}
    before, after = draw(units(pre, 3)), draw(units(post, 3))
    us = before + block * count + after
    edges = []
    for b in range(count):
        base = pre + b * size
        edges += [Edge(base + i, base + j, *inner_t[(i, j)]) for i, j in inner]
        if b + 1 < count:
            edges += [Edge(base + i, base + size + j, *cross_t[(i, j)]) for i, j in cross]
    ports = sorted({i for i, _ in cross})
    first_in = sorted({j for _, j in cross})
    if pre:
        j = draw(st.sampled_from(first_in))
        edges.append(Edge(0, pre + j, *draw(tables(len(us[0].strategies), dims[j]))))
    if post:
        last = pre + (count - 1) * size + draw(st.sampled_from(ports))
        tail = len(us) - 1
        edges.append(
            Edge(last, tail, *draw(tables(len(us[last].strategies), len(us[tail].strategies))))
        )
    return CostProblem(us, tuple(edges)), (pre, size, count)


@st.composite
def hub_problems(draw, steps: int = 8):
    """An LSTM-like layer: a chain of `steps` units, a hub that touches every step through
    a coarse function of its strategy (like the owner of a shared weight: its edges depend
    only on the weight's layout), a second hub with full-rank edges (like a Concat of all
    steps), and an extra edge between the hub and the first step that sees the whole
    strategy. Exact dyadic costs, small enough for brute force."""
    hub_dim = draw(st.integers(3, 4))
    classes = draw(st.integers(1, hub_dim - 1))
    label = [draw(st.integers(0, classes - 1)) for _ in range(hub_dim)]
    chain = draw(units(steps, 2))
    hub = Unit("hub", tuple(Strategy(f"h{j}", draw(COST), draw(MEM)) for j in range(hub_dim)))
    cat = Unit("cat", tuple(Strategy(f"c{j}", draw(COST), draw(MEM)) for j in range(2)))
    us = (hub, *chain, cat)
    cat_i = len(us) - 1
    edges = []
    for k in range(1, steps + 1):
        if k < steps:
            t, m = draw(tables(len(us[k].strategies), len(us[k + 1].strategies)))
            edges.append(Edge(k, k + 1, t, m))
        ct, cm = draw(tables(classes, len(us[k].strategies)))
        t = tuple(ct[label[j]] for j in range(hub_dim))
        m = tuple(cm[label[j]] for j in range(hub_dim))
        if draw(st.booleans()):  # either direction
            edges.append(Edge(0, k, t, m))
        else:
            edges.append(Edge(k, 0, tuple(zip(*t, strict=True)), tuple(zip(*m, strict=True))))
        t, m = draw(tables(len(us[k].strategies), 2))
        edges.append(Edge(k, cat_i, t, m))
    t, m = draw(tables(hub_dim, len(us[1].strategies)))
    edges.append(Edge(0, 1, t, m))
    return CostProblem(us, tuple(edges), devices=1, mesh=(1,))
