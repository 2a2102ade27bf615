"""ForwardCost's closed forms against numpy's LAPACK: the condition number that decides which terms
the fit keeps, and the solution of the normal equations (forward_cost.py keeps plain floats because
numpy's per-call overhead on 3 x 3 arrays was on every stream's path between two steps)."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.generation.forward_cost import ForwardCost, _condition, _solve


@pytest.mark.parametrize("size", [1, 2, 3])
def test_condition_and_solve_match_numpy_on_gram_matrices(size):
    rng = np.random.default_rng(size)
    for trial in range(500):
        features = rng.normal(size=(size + 2, size)) * rng.uniform(0.01, 100, size=size)
        gram = features.T @ features
        if trial % 5 == 0 and size > 1:  # singular: one feature a multiple of another
            gram[:, -1] = gram[:, 0] * 3.0
            gram[-1, :] = gram[0, :] * 3.0
            gram[-1, -1] = gram[0, 0] * 9.0
        want = np.linalg.cond(gram)
        got = _condition(gram.tolist())
        assert (got > 1e8) == (want > 1e8)
        if want < 1e6:
            assert got == pytest.approx(want, rel=1e-6)
            b = rng.normal(size=size)
            np.testing.assert_allclose(_solve(gram.tolist(), b.tolist()), np.linalg.solve(gram, b), rtol=1e-7)


def test_costs_are_those_of_the_least_squares_fit_over_weighted_forwards():
    """t0 + t1 n + t2 [n > 1], fitted by exponentially weighted least squares (numpy's lstsq as the
    reference), with the sums shared between sessions as numpy moments."""
    rng = np.random.default_rng(0)
    cost = ForwardCost(decay=0.95, outlier_ratio=1e9)  # no clamping: the plain fit
    rows, times, weights = [], [], []
    for step in range(60):
        n = int(rng.integers(1, 9))
        seconds = 0.01 + 0.002 * n + (0.004 if n > 1 else 0.0) + float(rng.normal(0, 0.0005))
        cost.observe(n, seconds)
        rows.append([1.0, n, 1.0 if n > 1 else 0.0])
        times.append(seconds)
    weights = 0.95 ** np.arange(len(rows))[::-1]
    a, t = np.array(rows) * np.sqrt(weights)[:, None], np.array(times) * np.sqrt(weights)
    theta = np.linalg.lstsq(a, t, rcond=None)[0]
    for n in range(1, 10):
        want = theta[0] + theta[1] * n + (theta[2] if n > 1 else 0.0)
        assert cost.cost(n) == pytest.approx(want, rel=1e-9)
    moments = cost.moments()
    assert isinstance(moments, np.ndarray) and moments[0, 0] == pytest.approx(1.0)
    copy = ForwardCost()
    copy.start_from(moments, weight=float(weights.sum()))
    assert [copy.cost(n) for n in range(1, 10)] == pytest.approx([cost.cost(n) for n in range(1, 10)], rel=1e-9)
