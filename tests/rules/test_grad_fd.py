"""Every gradient rule against central finite differences in float64 (property tests).

The per-family modules hold the hypothesis strategies (``CASES``: op type -> a strategy
drawing a random instance: shapes, attributes, inputs); this module runs them all.
"""

from __future__ import annotations

import pytest
import test_grad_conv
import test_grad_elementwise
import test_grad_gather
import test_grad_matmul
import test_grad_misc
import test_grad_nn
import test_grad_reduce
import test_grad_shape
from grad_harness import FAST, SLOW, check_gradients
from hypothesis import given
from hypothesis import strategies as st

CASES = {
    f"{module.__name__.removeprefix('test_grad_')}:{op}": strategy
    for module in (
        test_grad_conv,
        test_grad_elementwise,
        test_grad_gather,
        test_grad_matmul,
        test_grad_misc,
        test_grad_nn,
        test_grad_reduce,
        test_grad_shape,
    )
    for op, strategy in module.CASES.items()
}


@pytest.mark.parametrize("case", sorted(CASES))
@FAST
@given(data=st.data())
def test_matches_finite_differences(case, data):
    check_gradients(data.draw(CASES[case], label=case))


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
@SLOW
@given(data=st.data())
def test_matches_finite_differences_sweep(case, data):
    check_gradients(data.draw(CASES[case], label=case))
