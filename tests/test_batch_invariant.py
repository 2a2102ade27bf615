"""Batch-invariant steps (specdec/models/batch_invariant.py): a row computes exactly what it computes
alone, whatever else the step holds, so a verify's logits equal one-token decodes' bit for bit and
speculative greedy output cannot part from plain decoding even at a near-tie."""

from __future__ import annotations

import pytest
import torch

from models_helpers import random_tokens, tiny_dir
from specdec.errors import InvalidArgument
from specdec.models import cpu_linear
from specdec.models.batch_invariant import FixedRowsLinear, rows_for
from specdec.models.linear_kernels import DenseLinear, choose_linear
from specdec.models.llama import LlamaModel
from specdec.rpc_convert import model_info_from_proto, model_info_to_proto
from specdec.server.settings import ConfigError, ServerSettings

ROW_COUNTS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 40)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


def cpu_kernels():
    kernels = [DenseLinear()]
    try:
        kernels.append(choose_linear(torch.device("cpu"), torch.float32, "hybrid"))
    except ValueError:  # no usable oneDNN in this torch build
        pass
    try:
        kernels.append(choose_linear(torch.device("cpu"), torch.float32, "loop"))
    except ValueError:  # no numba
        pass
    return kernels


@pytest.mark.parametrize("kernel", cpu_kernels(), ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_every_row_of_a_fixed_rows_product_is_its_product_alone(kernel, rows):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 160, generator=generator) / 12
    x, residual = torch.randn(40, 160, generator=generator), torch.randn(40, 96, generator=generator)
    bias = torch.randn(96, generator=generator)
    fixed = FixedRowsLinear(kernel, rows)
    w = fixed.prepare(weight)
    alone = torch.cat([fixed(x[i:i + 1], w, bias) for i in range(40)])
    alone_add = torch.cat([fixed.add(residual[i:i + 1], x[i:i + 1], w) for i in range(40)])
    for m in ROW_COUNTS:
        assert torch.equal(fixed(x[:m], w, bias), alone[:m]), m
        assert torch.equal(fixed.add(residual[:m], x[:m], w), alone_add[:m]), m
    # and it is the same product as the kernel's own, up to rounding
    assert torch.allclose(alone, kernel(x, w, bias), atol=1e-5)
    assert torch.allclose(alone_add, kernel.add(residual, x, w), atol=1e-5)


def test_a_residual_padded_ahead_keeps_its_rows_and_x_is_padded_to_it():
    """The model's residual stream runs padded to whole chunks (LlamaModel.pad_rows) while the attention's
    output holds only the real tokens: add pads x to the residual, and every residual row comes back."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(24, 32, generator=generator)
    fixed = FixedRowsLinear(DenseLinear(), 8)
    w = fixed.prepare(weight)
    x, residual = torch.randn(3, 32, generator=generator), torch.randn(16, 24, generator=generator)
    out = fixed.add(residual, x, w)
    assert out.shape == (16, 24)
    assert torch.equal(out[:3], fixed.add(residual[:3], x, w))
    assert torch.equal(out[3:], residual[3:])  # x's padding is zero rows


def test_rows_per_product_must_be_positive():
    with pytest.raises(ValueError, match="rows per product must be >= 1"):
        FixedRowsLinear(DenseLinear(), 0)
    assert rows_for(torch.device("cpu")) == 8 and rows_for(torch.device("cuda", 0)) == 160


def step_logits(model: LlamaModel, slots, rows) -> list[torch.Tensor]:
    """One forward of `rows` into `slots`, undone afterwards; every row's logits."""
    before = [model.length(s) for s in slots]
    logits = model.forward(slots, rows)
    for slot, length in zip(slots, before):
        model.truncate(slot, length)
    return logits


def probe_model(path, batch_invariant: bool, linear_kernel: str, dtype="float32", device="cpu",
                cuda_graphs=False) -> LlamaModel:
    model = LlamaModel(path, device=device, dtype=dtype, num_slots=8, max_context=300, linear_kernel=linear_kernel,
                       cuda_graphs=cuda_graphs, batch_invariant=batch_invariant)
    for slot in range(8):
        assert model.allocate() == slot
        model.forward([slot], [random_tokens(30 + 17 * slot, seed=slot)], [1])
    return model


def batch_differences(model: LlamaModel) -> list[str]:
    """Where slot 0's next token, and its verify of 5, computed inside steps of other sessions' decodes
    and verifies differ (in any bit) from the same computed alone; [] when batch-invariant."""
    mine, verify = [[7]], [[7, 3, 250, 9, 41]]
    others = {s: random_tokens(9, seed=100 + s) for s in range(1, 8)}
    alone, alone_verify = step_logits(model, [0], mine)[0], step_logits(model, [0], verify)[0]
    differing = []
    if not torch.equal(alone_verify[0], alone[0]):
        differing.append("a verify's first row against the decode")
    for label, slots, width in (("among 3 decodes", [0, 1, 2, 3], 1), ("among 7 decodes", list(range(8)), 1),
                                ("among 7 verifies of 5", list(range(8)), 5), ("among 7 verifies of 9", list(range(8)), 9)):
        rest = [others[s][:width] for s in slots[1:]]
        if not torch.equal(step_logits(model, slots, mine + rest)[0], alone):
            differing.append(f"decode {label}")
        if not torch.equal(step_logits(model, slots, verify + rest)[0], alone_verify):
            differing.append(f"verify {label}")
    return differing


@pytest.mark.parametrize("linear_kernel", [k.name for k in cpu_kernels()])
def test_a_row_computes_what_it_computes_alone(root, linear_kernel):
    """On this CPU, without the mode, MKL's products of 4+ rows (and the hybrid kernel's oneDNN) round
    differently from one-row products: the rows differ; with it, no bit differs. The CPU's forward as
    the services run it (the static CUDA-graph path is checked on CUDA below: uncaptured on a CPU its
    SDPA tiles queries by the step's width)."""
    path = tiny_dir(root, "llama3")
    model = probe_model(path, True, linear_kernel)
    assert model.info.batch_invariant and isinstance(model.linear, FixedRowsLinear)
    assert batch_differences(model) == []


@pytest.mark.skipif("loop" not in [k.name for k in cpu_kernels()], reason="numba missing: no loop kernel")
def test_with_the_loop_kernel_the_mode_pads_nothing(root):
    """The compiled loop's rows are invariant by themselves up to cpu_linear.MAX_ROWS: the mode then
    cuts wider products (the 72 rows of eight verifies of 9 in batch_differences) into unpadded chunks,
    and a decode step multiplies one row, not eight."""
    model = probe_model(tiny_dir(root, "llama3"), True, "loop")
    assert model.pad_rows == 0 and not model.linear.pad and model.linear.rows == cpu_linear.MAX_ROWS
    assert batch_differences(model) == []
    seen, inner = [], model.linear.inner

    class Counting:  # the loop kernel, recording each product's rows
        def __call__(self, x, w, bias=None):
            seen.append(x.shape[0])
            return inner(x, w, bias)

        def add(self, residual, x, w):
            seen.append(x.shape[0])
            return inner.add(residual, x, w)

    model.linear.inner = Counting()
    step_logits(model, [0], [[7]])
    assert seen and set(seen) == {1}


@pytest.mark.parametrize("rows", [1, 3, 32])
def test_any_chunk_size_keeps_rows_as_alone(root, rows):
    """--batch-invariant-rows: a chunk of 1 row (each row its own product), one that splits every
    verify, one wider than any step here: each fixed count gives every row its own result."""
    model = LlamaModel(tiny_dir(root, "llama3"), num_slots=8, max_context=300, linear_kernel="dense",
                       batch_invariant=True, batch_invariant_rows=rows)
    assert model.pad_rows == rows and model.linear.rows == rows
    for slot in range(8):
        model.allocate()
        model.forward([slot], [random_tokens(30 + 17 * slot, seed=slot)], [1])
    assert batch_differences(model) == []


def test_without_the_mode_rows_depend_on_their_batch_here(root):
    """The premise of the test above on this kind of machine (x86 CPU, float32): the plain kernels'
    rows do depend on the batch, so the test above checks the mode and not a lucky kernel."""
    model = probe_model(tiny_dir(root, "llama3"), False, "dense")
    assert not model.info.batch_invariant
    assert batch_differences(model) != []


def test_bfloat16_rows_compute_what_they_compute_alone(root):
    model = probe_model(tiny_dir(root, "qwen2"), True, "dense", dtype="bfloat16")
    assert batch_differences(model) == []


def test_the_padded_stream_computes_what_padding_each_product_computes(root):
    """The residual stream padded once per forward (pad_rows; qwen2 has biases, so its padding rows are
    not zeros after the first layer) against every product padding its own input: the same bits."""
    model = probe_model(tiny_dir(root, "qwen2"), True, "dense")
    assert model.pad_rows == 8
    rows = [random_tokens(n, seed=40 + n) for n in (1, 5, 3, 9, 2)]
    slots = list(range(len(rows)))
    padded_once = step_logits(model, slots, rows)
    model.pad_rows = 0
    per_product = step_logits(model, slots, rows)
    assert all(torch.equal(a, b) for a, b in zip(padded_once, per_product))


def test_the_mode_is_refused_with_compiled_layers_and_other_backends(root):
    path = tiny_dir(root, "llama3")
    with pytest.raises(InvalidArgument, match="compile_layers"):
        LlamaModel(path, batch_invariant=True, compile_layers=True, cuda_graphs=True)
    from specdec.models.loader import load_model

    with pytest.raises(InvalidArgument, match="native backend only"):
        load_model(path, backend="hf", batch_invariant=True)
    from target_service.main import TargetServiceSettings

    with pytest.raises(ConfigError, match="--batch-invariant cannot be combined with --compile-layers"):
        TargetServiceSettings(server=ServerSettings(plaintext=True), model="m", batch_invariant=True, compile_layers=True)
    with pytest.raises(ConfigError, match="--batch-invariant needs --backend native"):
        TargetServiceSettings(server=ServerSettings(plaintext=True), model="m", batch_invariant=True, backend="hf")
    with pytest.raises(ConfigError, match="--batch-invariant-rows needs --batch-invariant"):
        TargetServiceSettings(server=ServerSettings(plaintext=True), model="m", batch_invariant_rows=160)
    for rows in (0, 5000):
        with pytest.raises(ConfigError, match=f"--batch-invariant-rows must be in 1..4096, got {rows}"):
            TargetServiceSettings(server=ServerSettings(plaintext=True), model="m", batch_invariant=True,
                                  batch_invariant_rows=rows)


def test_the_flag_reaches_the_settings_and_model_info_travels(root):
    from target_service.main import build_parser, settings_from_args

    settings = settings_from_args(build_parser().parse_args(["--batch-invariant", "--plaintext"]))
    assert settings.batch_invariant and settings.batch_invariant_rows is None
    settings = settings_from_args(build_parser().parse_args(["--batch-invariant", "--batch-invariant-rows", "16",
                                                             "--plaintext"]))
    assert settings.batch_invariant_rows == 16
    from draft_service.main import build_parser as draft_parser, settings_from_args as draft_settings

    draft = draft_settings(draft_parser().parse_args(["--model", "m", "--batch-invariant", "--batch-invariant-rows=3",
                                                        "--plaintext"]))
    assert draft.batch_invariant and draft.batch_invariant_rows == 3
    from specdec.bench.runner import BenchConfig

    bench = lambda *target_args: BenchConfig(target="m", target_args=target_args)  # noqa: E731
    assert bench("--batch-invariant", "--batch-invariant-rows=160").batch_invariant_rows == 160
    assert bench("--batch-invariant-rows", "96").batch_invariant_rows == 96
    assert bench("--batch-invariant").batch_invariant_rows is None
    assert bench("--batch-invariant").batch_invariant_target and not bench("--num-slots=4").batch_invariant_target
    assert not settings_from_args(build_parser().parse_args(["--plaintext"])).batch_invariant
    info = probe_model(tiny_dir(root, "llama3"), True, "dense").info
    assert model_info_from_proto(model_info_to_proto(info)).batch_invariant
    assert not model_info_to_proto(LlamaModel(tiny_dir(root, "llama3")).info).batch_invariant


# ---- CUDA: cuBLAS picks kernels by shape; half precision ------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_rows_compute_what_they_compute_alone(root, dtype):
    model = probe_model(tiny_dir(root, "llama3"), True, "auto", dtype=dtype, device="cuda", cuda_graphs=True)
    assert batch_differences(model) == []
    assert model.graphs.stats.replays > 0


@pytest.mark.skipif("loop" not in [k.name for k in cpu_kernels()], reason="numba missing: no loop kernel")
def test_auto_calibrates_outside_the_mode_and_keeps_every_chunk_on_the_loop_inside_it(root):
    """Outside the mode "auto" measures up to how many rows the loop beats oneDNN (kernel_calibration.py)
    and may send a verify to oneDNN; inside it every chunk stays on the loop, whose rows keep their bits."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        calibrated = LlamaModel(tiny_dir(root, "llama3"), num_slots=2, max_context=64)
        assert calibrated.linear.name == "loop" and 0 <= calibrated.linear.loop_rows <= cpu_linear.MAX_ROWS
        inside = LlamaModel(tiny_dir(root, "llama3"), num_slots=2, max_context=64, batch_invariant=True)
        assert inside.linear.inner.loop_rows == cpu_linear.MAX_ROWS and not inside.linear.inner.calibrate
    finally:
        torch.set_num_threads(threads)
