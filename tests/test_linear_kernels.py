"""The CPU linear kernels compute the same products; "auto" picks the compiled loop at one thread and
measures, on the model's weights, up to how many rows the loop beats oneDNN."""

from __future__ import annotations

import pytest
import torch

from specdec.models import cpu_linear, kernel_calibration
from specdec.models.linear_kernels import DenseLinear, HybridLinear, LoopLinear, OneDnnLinear, choose_linear

onednn = pytest.mark.skipif(not isinstance(choose_linear(torch.device("cpu"), torch.float32, "onednn"),
                                           OneDnnLinear), reason="no oneDNN in this torch build")


@onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 12, 13, 40])  # 2: padded to 4 rows on oneDNN; 13+: the loop's oneDNN
def test_kernels_agree_for_one_and_several_rows(rows):
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    x, residual = torch.randn(rows, 32, generator=g), torch.randn(rows, 48, generator=g)
    expected = x @ weight.T
    kernels = [DenseLinear(), OneDnnLinear(), HybridLinear(), LoopLinear(True), LoopLinear(False)]
    for kernel in kernels + ([LoopLinear(True, threads=2)] if cpu_linear.available(2) else []):
        w = kernel.prepare(weight)
        assert kernel(x, w).shape == (rows, 48) and kernel.add(residual, x, w).shape == (rows, 48)
        torch.testing.assert_close(kernel(x, w), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kernel(x, w, bias), expected + bias, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kernel.add(residual, x, w), residual + expected, rtol=1e-5, atol=1e-5)


@onednn
def test_auto_is_the_loop_at_one_and_two_threads_and_onednn_above(monkeypatch):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert choose_linear(torch.device("cpu"), torch.float32).name == "loop"
        assert choose_linear(torch.device("cpu"), torch.bfloat16).name != "loop"  # the loop is float32 only
        monkeypatch.setenv("SPECDEC_LINEAR_KERNEL", "hybrid")  # the benchmarks' A/B switch
        assert choose_linear(torch.device("cpu"), torch.float32).name == "hybrid"
        assert choose_linear(torch.device("cpu"), torch.float32, "dense").name == "dense"  # named: kept
        monkeypatch.delenv("SPECDEC_LINEAR_KERNEL")
        torch.set_num_threads(2)
        at_two = choose_linear(torch.device("cpu"), torch.float32)
        # the loop's parallel build, where numba's threading layer is safe for it (OpenMP or TBB)
        assert (at_two.name, getattr(at_two, "threads", None)) == (("loop", 2) if cpu_linear.available(2) else ("onednn", None))
        assert choose_linear(torch.device("cpu"), torch.float16).name == "dense"  # no oneDNN fp16 path here
        torch.set_num_threads(3)
        assert choose_linear(torch.device("cpu"), torch.float32).name == "onednn"
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError):
        choose_linear(torch.device("cpu"), torch.float32, "fastest")


def test_the_loop_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="float32 on a CPU"):
        choose_linear(torch.device("cpu"), torch.bfloat16, "loop")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        with pytest.raises(ValueError, match="1 or 2 intra-op threads"):
            choose_linear(torch.device("cpu"), torch.float32, "loop")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("width", [32, 576, 1536])
def test_a_loop_row_has_the_same_bits_whatever_rows_share_its_call(width, threads):
    """cpu_linear's claim: rows in pairs and the odd last row alone reduce in one order, so a verify
    row's product equals its one-row (decode) product bit for bit, for every count up to MAX_ROWS,
    serial or split over two threads (which split the weight's rows, not a sum), and both builds
    give the same bits. Widths of the default target's products (576, 1536) and of a tiny model (32)."""
    if not cpu_linear.available(threads):
        pytest.skip(f"no loop build for {threads} threads here")
    g = torch.Generator().manual_seed(1)
    weight, x = torch.randn(64, width, generator=g), torch.randn(cpu_linear.MAX_ROWS, width, generator=g)
    residual = torch.randn(cpu_linear.MAX_ROWS, 64, generator=g)
    alone = torch.cat([cpu_linear.product(x[i:i + 1], weight, threads) for i in range(len(x))])
    alone_add = torch.cat([cpu_linear.product_add(residual[i:i + 1], x[i:i + 1], weight, threads)
                           for i in range(len(x))])
    for rows in range(1, cpu_linear.MAX_ROWS + 1):
        assert torch.equal(cpu_linear.product(x[:rows], weight, threads), alone[:rows]), rows
        assert torch.equal(cpu_linear.product_add(residual[:rows], x[:rows], weight, threads), alone_add[:rows]), rows
    assert torch.equal(alone, torch.cat([cpu_linear.product(x[i:i + 1], weight) for i in range(len(x))]))
    torch.testing.assert_close(alone, x @ weight.T, rtol=1e-5, atol=1e-4)


@onednn
def test_auto_asks_for_calibration_and_a_named_loop_runs_up_to_max_rows(monkeypatch):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        auto = choose_linear(torch.device("cpu"), torch.float32)
        assert auto.name == "loop" and auto.calibrate
        named = choose_linear(torch.device("cpu"), torch.float32, "loop")
        assert not named.calibrate and named.loop_rows == cpu_linear.MAX_ROWS
        monkeypatch.setenv("SPECDEC_LINEAR_KERNEL", "loop")  # the A/B switch pins the loop without calibration
        assert not choose_linear(torch.device("cpu"), torch.float32).calibrate
    finally:
        torch.set_num_threads(threads)
    assert not LoopLinear(False, calibrate=True).calibrate  # no oneDNN: nothing to choose between


@onednn
def test_rows_above_loop_rows_go_to_onednn_and_the_rest_to_the_loop():
    g = torch.Generator().manual_seed(2)
    kernel = LoopLinear(True)  # built for one thread
    kernel.loop_rows = 2
    weight = torch.randn(96, 64, generator=g)
    w = kernel.prepare(weight)
    threads = torch.get_num_threads()
    try:
        for forward_threads in (1, 2):  # 2: a wide step (step_threads.py) runs every product on oneDNN
            torch.set_num_threads(forward_threads)
            for rows in (1, 2, 3, 5):
                x, residual = torch.randn(rows, 64, generator=g), torch.randn(rows, 96, generator=g)
                if rows <= 2 and forward_threads == 1:
                    assert torch.equal(kernel(x, w), cpu_linear.product(x, weight))
                    assert torch.equal(kernel.add(residual, x, w), cpu_linear.product_add(residual, x, weight))
                else:
                    assert torch.equal(kernel(x, w), OneDnnLinear()(x, w.packed))
                    assert torch.equal(kernel.add(residual, x, w), OneDnnLinear().add(residual, x, w.packed))
    finally:
        torch.set_num_threads(threads)


@onednn
def test_calibration_times_both_kernels_on_real_weights():
    g = torch.Generator().manual_seed(3)
    kernel = LoopLinear(True, calibrate=True)
    weights = [kernel.prepare(torch.randn(256, 128, generator=g)) for _ in range(4)]
    assert 0 <= kernel_calibration.loop_rows(kernel, weights, repeats=1) <= cpu_linear.MAX_ROWS


@pytest.mark.parametrize(("loop_ms", "onednn_ms", "expected"), [
    ({1: 10, 2: 12, 3: 14, 4: 16}, {1: 12, 2: 12.5, 3: 12, 4: 12}, 2),  # oneDNN ahead from 3 rows
    ({1: 10, 2: 10}, {1: 9.9, 2: 5}, 1),  # a near-tie (within MARGIN) stays with the loop
    ({1: 10}, {1: 8}, 0),  # the loop loses even one row: oneDNN for every product
    ({}, {}, cpu_linear.MAX_ROWS),  # the loop never loses
])
def test_the_loop_keeps_every_row_count_up_to_its_first_clear_loss(monkeypatch, loop_ms, onednn_ms, expected):
    """The decision on given timings: rows are tried in order and the first where oneDNN is faster by
    more than MARGIN ends the loop's range (counts not listed: the loop wins)."""
    tried = []

    def least(runs, repeats, order):
        rows = len(tried) + 1
        tried.append(rows)
        return {"loop": loop_ms.get(rows, 1) / 1e3, "onednn": onednn_ms.get(rows, 2) / 1e3}

    monkeypatch.setattr(kernel_calibration, "_least", least)
    kernel = LoopLinear(True, calibrate=True)
    assert kernel_calibration.loop_rows(kernel, [kernel.prepare(torch.ones(8, 8))]) == expected
    assert tried == list(range(1, min(expected + 1, cpu_linear.MAX_ROWS) + 1))  # it stops at the first loss
