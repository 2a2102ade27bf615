"""GUMBEL mode: token-for-token equal to plain decoding; its acceptance, measured against
rejection sampling's optimum.

Acceptance of one drafted token whose draft distribution is draft_probs and target distribution is
target_probs:
- rejection sampling: sum_x min(target_probs[x], draft_probs[x]) = 1 - TV, the largest any
  coupling of the two can reach (the acceptance rate alpha of Leviathan et al. 2023, sec. 3).
- Gumbel coupling: both take argmax(log probs + g) with the same g. With g = -log E (E_x i.i.d.
  Exp(1)) both pick x iff E_y > E_x * max(target_probs[y] / target_probs[x],
  draft_probs[y] / draft_probs[x]) for every y, so the acceptance is exactly
  sum_x 1 / sum_y max(target_probs[y] / target_probs[x], draft_probs[y] / draft_probs[x]),
  which is <= 1 - TV term by term and >= (1 - TV) / (1 + TV) (Daliri et al. 2024, "Coupling
  without communication and drafter-invariant speculative decoding").
"""

from __future__ import annotations

import pytest
import torch

from specdec.sampling import rng
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.sampling.warp import warp_logits
from sampling_helpers import (  # noqa: F401 (single_torch_thread is an autouse fixture)
    noisy_copy,
    plain_generate,
    prefix_model,
    single_torch_thread,
    speculative_generate,
)

GUMBEL_SETTINGS = [
    SamplingParams(temperature=1.0, seed=1, mode=SamplingMode.GUMBEL),
    SamplingParams(temperature=0.7, top_k=5, seed=2, mode=SamplingMode.GUMBEL),
    SamplingParams(temperature=1.3, top_p=0.9, seed=3, mode=SamplingMode.GUMBEL),
]


@pytest.mark.parametrize("params", GUMBEL_SETTINGS, ids=["t1.0", "t0.7-topk5", "t1.3-topp0.9"])
@pytest.mark.parametrize("k, top_m", [(1, 0), (3, 0), (5, 3)])
def test_speculative_output_equals_plain_decoding_token_for_token(params, k, top_m):
    target = prefix_model(f"gumbel-target-{params.seed}", 8, scale=1.5)
    draft = noisy_copy(target, f"gumbel-draft-{params.seed}", 8, noise=1.0)
    prompt = (3, 1, 4)
    speculative, outcomes = speculative_generate(target, draft, prompt, 60, params, k, top_m)
    assert speculative == plain_generate(target, prompt, 60, params)
    # Not vacuous: some drafted tokens were accepted and some rejected.
    assert any(o.num_accepted > 0 for o in outcomes)
    assert any(o.num_accepted < o.num_drafted for o in outcomes)


def exact_gumbel_acceptance(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> float:
    """Closed form of P(argmax(log target_probs + g) == argmax(log draft_probs + g)); [vocab]."""
    total = 0.0
    for x in torch.nonzero((target_probs > 0) & (draft_probs > 0))[:, 0].tolist():
        ratios = torch.maximum(target_probs / target_probs[x], draft_probs / draft_probs[x])
        total += 1.0 / float(ratios.sum())
    return total


def measured_gumbel_acceptance(target_probs, draft_probs, noise: torch.Tensor) -> float:
    """Fraction of noise rows on which draft and target pick the same token; noise [n, vocab]."""
    target_tokens = (torch.log(target_probs) + noise).argmax(dim=-1)
    draft_tokens = (torch.log(draft_probs) + noise).argmax(dim=-1)
    return float((target_tokens == draft_tokens).double().mean())


def synthetic_pairs(vocab: int = 64):
    """(name, target_probs, draft_probs) float64 [vocab]: drafts of decreasing quality."""
    generator = torch.Generator().manual_seed(0)
    target = torch.randn(vocab, generator=generator, dtype=torch.float64) * 2
    noise = torch.randn(vocab, generator=generator, dtype=torch.float64)
    plain = SamplingParams(temperature=1.0)
    nucleus = SamplingParams(temperature=0.7, top_p=0.9)
    top_m = torch.softmax(target + 0.5 * noise, -1)
    top_m[top_m < top_m.topk(8).values[-1]] = 0  # a draft that sends only its top 8
    target_probs = torch.softmax(target, -1)
    return [
        ("close draft (logit noise 0.5)", target_probs, torch.softmax(target + 0.5 * noise, -1)),
        ("medium draft (logit noise 1.0)", target_probs, torch.softmax(target + noise, -1)),
        ("poor draft (logit noise 2.0)", target_probs, torch.softmax(target + 2 * noise, -1)),
        ("over-smoothed draft (logits / 2)", target_probs, torch.softmax(target / 2, -1)),
        ("top-8 draft (logit noise 0.5)", target_probs, top_m / top_m.sum()),
        ("T=0.7 top-p=0.9, noise 0.5", warp_logits(target, nucleus).double(),
         warp_logits(target + 0.5 * noise, nucleus).double()),
        ("independent draft", warp_logits(target, plain).double(),
         torch.softmax(torch.randn(vocab, generator=generator, dtype=torch.float64) * 2, -1)),
    ]


def test_gumbel_acceptance_is_at_most_rejection_acceptance():
    draws, vocab = 20_000, 64
    noise = torch.stack([rng.gumbel_noise(11, position, vocab) for position in range(draws)])
    print(f"\n{'pair':36} {'rejection':>9} {'gumbel':>7} {'measured':>8} {'lower bound':>11}")
    for name, target_probs, draft_probs in synthetic_pairs(vocab):
        rejection = float(torch.minimum(target_probs, draft_probs).sum())
        exact = exact_gumbel_acceptance(target_probs, draft_probs)
        measured = measured_gumbel_acceptance(target_probs, draft_probs, noise)
        distance = 1.0 - rejection
        lower = (1.0 - distance) / (1.0 + distance)
        print(f"{name:36} {rejection:9.4f} {exact:7.4f} {measured:8.4f} {lower:11.4f}")
        standard_error = (exact * (1 - exact) / draws) ** 0.5
        assert abs(measured - exact) < 5 * standard_error + 1e-9  # the real noise, the closed form
        assert measured <= rejection + 5 * standard_error
        assert lower - 1e-12 <= exact <= rejection + 1e-12


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_speculative_loop_acceptance_gumbel_versus_rejection(temperature):
    """End to end on a tiny prefix model (vocab 16, draft = target logits + noise 0.7), k = 4:
    the fraction of drafted tokens accepted in each mode, and the exact per-token acceptance of
    each mode averaged over the contexts the loop visited (printed for docs/VERIFICATION.md)."""
    target = prefix_model("loop-target", 16, scale=2.0)
    draft = noisy_copy(target, "loop-draft", 16, noise=0.7)
    measured, exact = {}, {"rejection": [], "gumbel": []}
    for mode in SamplingMode:
        accepted = drafted = 0
        for seed in range(10):
            params = SamplingParams(temperature=temperature, seed=seed, mode=mode)
            tokens, outcomes = speculative_generate(target, draft, (1, 2), 60, params, k=4)
            accepted += sum(o.num_accepted for o in outcomes)
            drafted += sum(o.num_drafted for o in outcomes)
            for end in range(len(tokens)):
                context = (1, 2) + tuple(tokens[:end])
                target_probs = warp_logits(target(context), params).double()
                draft_probs = warp_logits(draft(context), params).double()
                exact["rejection"].append(float(torch.minimum(target_probs, draft_probs).sum()))
                exact["gumbel"].append(exact_gumbel_acceptance(target_probs, draft_probs))
        measured[mode.value] = accepted / drafted
    mean = {mode: sum(values) / len(values) for mode, values in exact.items()}
    print(f"\nT={temperature}: accepted/drafted {measured}; per-token acceptance {mean}")
    assert mean["gumbel"] <= mean["rejection"]
    assert all(0.0 < rate < 1.0 for rate in measured.values())
