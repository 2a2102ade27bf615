"""The CPU linear kernels compute the same products; "auto" picks the hybrid at one thread."""

from __future__ import annotations

import pytest
import torch

from specdec.models.linear_kernels import DenseLinear, HybridLinear, OneDnnLinear, choose_linear

onednn = pytest.mark.skipif(not isinstance(choose_linear(torch.device("cpu"), torch.float32, "auto"),
                                           (OneDnnLinear, HybridLinear)), reason="no oneDNN in this torch build")


@onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 5])  # 2: padded to 4 rows on oneDNN
def test_kernels_agree_for_one_and_several_rows(rows):
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    x, residual = torch.randn(rows, 32, generator=g), torch.randn(rows, 48, generator=g)
    expected = x @ weight.T
    for kernel in (DenseLinear(), OneDnnLinear(), HybridLinear()):
        w = kernel.prepare(weight)
        assert kernel(x, w).shape == (rows, 48) and kernel.add(residual, x, w).shape == (rows, 48)
        torch.testing.assert_close(kernel(x, w), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kernel(x, w, bias), expected + bias, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kernel.add(residual, x, w), residual + expected, rtol=1e-5, atol=1e-5)


@onednn
def test_auto_is_hybrid_at_one_thread_and_onednn_above():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert choose_linear(torch.device("cpu"), torch.float32).name == "hybrid"
        torch.set_num_threads(2)
        assert choose_linear(torch.device("cpu"), torch.float32).name == "onednn"
        assert choose_linear(torch.device("cpu"), torch.float16).name == "dense"  # no oneDNN fp16 path here
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError):
        choose_linear(torch.device("cpu"), torch.float32, "fastest")
