"""Counter-based randomness: reproducible per (seed, position, stream), independent across them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from specdec.sampling import rng
from specdec.sampling.rng import Stream
from sampling_helpers import single_torch_thread  # noqa: F401 (autouse fixture)


def test_uniform_is_a_pure_function_of_seed_position_and_stream():
    assert rng.uniform(7, 123, Stream.ACCEPT) == rng.uniform(7, 123, Stream.ACCEPT)
    draws = {rng.uniform(seed, position, stream)
             for seed in (0, 1, 2**63 - 1) for position in (0, 1, 2, 10**12) for stream in Stream}
    assert len(draws) == 3 * 4 * len(Stream)  # every key and counter gives a different number


def test_vectorised_uniforms_equal_numpy_philox_bit_for_bit():
    generator = np.random.default_rng(0)
    seeds = generator.integers(0, 2**63, 2000, dtype=np.uint64)
    positions = generator.integers(0, 2**62, 2000, dtype=np.uint64)
    positions[:10] = np.arange(10)
    for stream in Stream:
        expected = [rng.uniform(int(s), int(p), stream) for s, p in zip(seeds, positions)]
        assert rng.uniforms(seeds, positions, stream).tolist() == expected
    one_seed = [rng.uniform(5, int(p), Stream.DRAFT) for p in positions[:50]]
    assert rng.uniforms(5, positions[:50], Stream.DRAFT).tolist() == one_seed


def test_uniforms_are_uniform_and_independent_across_positions():
    u = rng.uniforms(11, np.arange(100_000), Stream.ACCEPT)
    assert u.min() >= 0.0 and u.max() < 1.0
    assert stats.kstest(u, "uniform").pvalue > 1e-3
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.02  # neighbouring positions
    other_stream = rng.uniforms(11, np.arange(100_000), Stream.RESAMPLE)
    assert abs(np.corrcoef(u, other_stream)[0, 1]) < 0.02


def test_gumbel_noise_is_deterministic_standard_gumbel_and_per_position():
    noise = rng.gumbel_noise(3, 40, 1000)
    assert noise.dtype == torch.float64 and noise.shape == (1000,)
    assert torch.equal(noise, rng.gumbel_noise(3, 40, 1000))
    assert torch.isfinite(noise).all()
    samples = torch.cat([rng.gumbel_noise(3, position, 1000) for position in range(50)])
    assert stats.kstest(samples.numpy(), "gumbel_r").pvalue > 1e-3
    # A large draw at one position does not run into the next position's numbers.
    assert not np.isin(rng.gumbel_noise(3, 41, 1000).numpy(), noise.numpy()).any()
    assert not torch.equal(rng.gumbel_noise(4, 40, 1000), noise)


def test_gumbel_argmax_never_picks_a_zero_probability_token():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    picks = {rng.gumbel_argmax(probs, 9, position) for position in range(300)}
    assert picks == {1, 3}


def test_sample_from_probs_is_deterministic_and_scale_free():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    first = [rng.sample_from_probs(probs, 1, position, Stream.RESAMPLE) for position in range(200)]
    again = [rng.sample_from_probs(probs * 2, 1, position, Stream.RESAMPLE)
             for position in range(200)]
    assert first == again  # weights need not be normalised; x2 is exact in floating point
    other_seed = [rng.sample_from_probs(probs, 2, position, Stream.RESAMPLE)
                  for position in range(200)]
    assert first != other_seed


def test_sample_rows_equals_sample_from_probs_row_by_row():
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(300, 17, generator=generator)
    probs *= torch.rand(300, 17, generator=generator) > 0.5  # many zero-mass tokens
    probs[:, 3] += 1e-3  # every row has some mass
    seeds = np.arange(300, dtype=np.uint64) * 7919
    positions = np.arange(300) + 1000
    together = rng.sample_rows(probs, seeds, positions, Stream.DRAFT).tolist()
    alone = [rng.sample_from_probs(probs[i], int(seeds[i]), int(positions[i]), Stream.DRAFT)
             for i in range(300)]
    assert together == alone


ADVERSARIAL = [
    [0.0, 1.0, 0.0],
    [0.0, 0.0, 1e-30, 0.0, 1.0, 0.0, 0.0],
    [1.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 1e-45],
    [0.3, 0.0, 0.7, 0.0, 1e-300, 0.0],
    [1e-8] * 5 + [0.0] * 3,
]
EXTREME_U = [0.0, 2.0**-53, 0.5, 1.0 - 2.0**-52, 1.0 - 2.0**-53]


@pytest.mark.parametrize("weights", ADVERSARIAL)
def test_inverse_cdf_never_returns_a_zero_probability_token(weights):
    probs = torch.tensor(weights, dtype=torch.float64)
    cdf_points = (torch.cumsum(probs, 0) / probs.sum()).tolist()
    # u = 1.0 is beyond the generator's range; it stands in for u * total rounding up to total.
    for u in EXTREME_U + [1.0] + cdf_points + [float(np.nextafter(c, 0.0)) for c in cdf_points]:
        index = int(rng.inverse_cdf(probs[None], torch.tensor([u], dtype=torch.float64))[0])
        assert probs[index] > 0, (weights, u, index)


def test_inverse_cdf_guard_takes_the_last_token_with_mass():
    probs = torch.tensor([[0.2, 0.0, 0.8, 0.0, 0.0]])
    assert int(rng.inverse_cdf(probs, torch.tensor([1.0], dtype=torch.float64))[0]) == 2


def test_sample_from_probs_never_returns_zero_probability_token_at_u_extremes(monkeypatch):
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0, 0.0], dtype=torch.float32)
    for u in EXTREME_U:
        monkeypatch.setattr(rng, "uniform", lambda seed, position, stream, u=u: u)
        assert probs[rng.sample_from_probs(probs, 0, 0, Stream.RESAMPLE)] > 0
    monkeypatch.undo()
    picks = {rng.sample_from_probs(probs, 0, position, Stream.RESAMPLE)
             for position in range(2000)}
    assert picks == {1, 3}


def test_sampling_from_no_mass_is_an_error():
    with pytest.raises(ValueError, match="no positive mass"):
        rng.sample_from_probs(torch.zeros(4), 0, 0, Stream.RESAMPLE)
