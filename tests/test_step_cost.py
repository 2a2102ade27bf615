"""The target's step-cost fit (specdec.engine.step_cost): tokens alone where the backend packs ragged
rows; for padded steps, what rows cost apart from what width costs, with an untold split held at
half and half until steps of other widths tell them apart, and at what they last told where that
was cheaper."""

from __future__ import annotations

import itertools

import pytest

from specdec.engine.step_cost import UNTOLD_SHARE, DraftStepPrice, StepCost

# One H200, 8B target with CUDA graphs (docs/BENCHMARKS.md, round 38): 6.1 ms a step, 0.38 ms a row,
# 0.01 ms a token of width.
ALPHA, PER_ROW, PER_TOKEN = 0.0061, 0.00038, 0.00001


def gpu_step(rows: int, width: int) -> float:
    return ALPHA + PER_ROW * rows + PER_TOKEN * rows * width


def test_tokens_alone_where_rows_are_packed():
    cost = StepCost()
    for n in [1, 5, 16, 80, 3, 40] * 3:
        cost.observe(n, 0.05 + 0.002 * n, rows=4)  # rows do not enter a packed fit
    assert cost.fit(1) == pytest.approx((0.05, 0.002)) and cost.fit(16) == pytest.approx((0.05, 0.002))


def test_plain_padded_steps_charge_half_of_their_growth_to_width():
    """Plain steps are one token wide: their growth by rows could be either cost, and the fit charges
    half of it to width until wider steps are measured."""
    cost = StepCost(per_row=True)
    for rows in [1, 3, 8, 5, 2, 7, 4, 6] * 3:
        cost.observe(rows, gpu_step(rows, 1), rows)
    alpha, beta = cost.fit(8)
    growth = PER_ROW + PER_TOKEN
    assert beta == pytest.approx(UNTOLD_SHARE * growth)
    assert alpha + beta * 8 == pytest.approx(gpu_step(8, 1))  # the plain steps it saw, exactly
    tokens_alone = StepCost()
    for rows in [1, 3, 8, 5, 2, 7, 4, 6] * 3:
        tokens_alone.observe(rows, gpu_step(rows, 1))
    a, b = tokens_alone.fit(8)
    wide = a + b * 40  # 8 rows of 5: 21.7 ms for a step that takes 9.5 (every draft at 8 sessions cut)
    assert wide > 2 * gpu_step(8, 5)
    assert alpha + beta * 40 < 0.75 * wide  # still dear, but cheap enough to try: then it is told


def test_steps_of_other_widths_tell_rows_from_tokens():
    cost = StepCost(per_row=True)
    for rows, width in itertools.product(range(1, 9), (1, 1, 1, 5)):
        cost.observe(rows * width, gpu_step(rows, width), rows)
    alpha, beta = cost.fit(8)
    assert beta == pytest.approx(PER_TOKEN, abs=2e-6)
    assert alpha + beta * 40 == pytest.approx(gpu_step(8, 5), rel=0.01)
    cpu = StepCost(per_row=True)  # where width is what costs (a CPU), the same fit says so
    for rows, width in itertools.product(range(1, 9), (1, 1, 1, 5)):
        cpu.observe(rows * width, 0.04 + 0.003 * rows * width, rows)
    alpha, beta = cpu.fit(8)
    assert beta == pytest.approx(0.003, rel=0.01) and alpha == pytest.approx(0.04, rel=0.01)


def test_the_split_returns_to_half_after_a_long_plain_stretch():
    """Measurements fade: long after the last wide step the trimming tries a width again (where the
    widths told that width is dearer than the half, the half is what is remembered)."""
    cost = StepCost(per_row=True)
    for rows, width in itertools.product(range(1, 9), (1, 5)):
        cost.observe(rows * width, 0.04 + 0.003 * rows * width, rows)
    told = cost.fit(8)[1]
    for rows in [1, 3, 8, 5, 2, 7, 4, 6] * 60:  # 480 plain steps
        cost.observe(rows, 0.04 + 0.003 * rows, rows)
    assert told == pytest.approx(0.003, rel=0.02)
    assert cost.fit(8)[1] < 0.65 * told  # most of the way back to the untold half (0.0015)


def test_a_cheap_width_is_remembered_through_a_plain_stretch():
    """Where the widths told that width is cheap (a GPU: 0.01 ms a token against 0.38 ms a row), a
    long plain stretch (another pool's turn on the same target) returns the fit to that split, not to
    the half, which would price one more token on 16 rows at 3 ms against 0.16 (round 40)."""
    cost = StepCost(per_row=True)
    for rows, width in itertools.product(range(1, 9), (1, 1, 1, 3, 5)):
        cost.observe(rows * width, gpu_step(rows, width), rows)
    assert cost.share == pytest.approx(PER_TOKEN / (PER_ROW + PER_TOKEN), rel=0.05)
    for rows in [16, 16, 16, 15, 16, 12, 16, 9] * 60:  # 480 plain steps
        cost.observe(rows, gpu_step(rows, 1), rows)
    alpha, beta = cost.fit(16)
    assert beta == pytest.approx(PER_TOKEN, rel=0.1)
    assert alpha + beta * 32 == pytest.approx(gpu_step(16, 2), rel=0.02)
    fresh = StepCost(per_row=True)  # never told: the half, as before
    for rows in [16, 16, 16, 15, 16, 12, 16, 9] * 60:
        fresh.observe(rows, gpu_step(rows, 1), rows)
    assert fresh.share == UNTOLD_SHARE and fresh.fit(16)[1] > 10 * PER_TOKEN


def test_a_graph_capture_inside_a_step_is_clamped():
    cost = StepCost(per_row=True)
    for rows, width in itertools.product(range(1, 9), (1, 1, 5)):
        cost.observe(rows * width, gpu_step(rows, width), rows)
    cost.observe(24, 0.2, 8)  # a first use of a shape past the warm-up context
    alpha, beta = cost.fit(8)
    assert alpha + beta * 40 < 1.25 * gpu_step(8, 5)


def test_the_hosted_drafts_step_is_priced_by_its_rows():
    """Nothing before a pass; the passes' mean while they all had the same rows; then a + b * rows
    (one H200, 1B hosted draft, round 39: 2.3 ms a step at 1 row, 3.5 at 8, 4.6 at 16)."""
    price = DraftStepPrice()
    assert price.at(8) == 0.0
    for _ in range(10):
        price.observe(rows=8, steps=2, seconds=2 * 0.0035)
    assert price.at(1) == price.at(16) == pytest.approx(0.0035)  # no slope told yet
    for rows in (1, 16, 4, 8, 2, 12) * 4:
        price.observe(rows=rows, steps=3, seconds=3 * (0.00215 + 0.000153 * rows))
    assert price.at(1) == pytest.approx(0.0023, rel=0.05)
    assert price.at(16) == pytest.approx(0.0046, rel=0.05)
    price.observe(rows=4, steps=0, seconds=1.0)  # a pass that drafted nothing tells nothing
    assert price.at(16) == pytest.approx(0.0046, rel=0.05)
