"""`specdec bench`'s command line: flags parse to what they name, and a refused value is a one-line
error before anything starts (no services, no models loaded)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from service_procs import REPO
from specdec.commands.bench import _delays


def test_delay_flags_parse_to_milliseconds():
    assert _delays("0.2ms,1ms") == (0.2, 1.0)
    assert _delays("200us, 3") == (0.2, 3.0)


def test_k_policy_names_every_fixed_length_and_the_server_policy():
    from specdec.bench.methods import base_name, fixed_k_of, parse_k_policy, policy_variants

    assert parse_k_policy("fixed", 4) == ([4], False)
    assert parse_k_policy("server", 4) == ([], True)
    assert parse_k_policy("fixed,server", 4) == ([4], True)
    assert parse_k_policy("fixed:1,2,3,4,6,8,server", 4) == ([1, 2, 3, 4, 6, 8], True)
    for bad in ("fixed:0", "fixed:x", "sometimes", ""):
        with pytest.raises(ValueError):
            parse_k_policy(bad, 4)
    names = policy_variants("specdec-draft", [1, 4, 8], True, 4)
    assert names == ["specdec-draft@k1", "specdec-draft", "specdec-draft@k8", "specdec-draft@server"]
    assert policy_variants("specdec-draft", [2], False, 4) == ["specdec-draft", "specdec-draft@k2"]
    assert [fixed_k_of(n, 4) for n in names] == [1, 4, 8, None]
    assert {base_name(n) for n in names} == {"specdec-draft"}


def test_method_choice_reports_what_is_not_built_or_lacks_a_draft():
    from specdec.bench.methods import SPECULATIVE, base_name, choose_methods, is_pipelined, is_service, proposer_of

    run, skipped = choose_methods(None, have_draft=False)
    assert "specdec-ngram" in run and "specdec-draft" not in run and "hf-assisted" not in run
    assert "specdec-ngram-pipelined" in run and "draft" in skipped["specdec-draft-pipelined"]
    assert "draft" in skipped["specdec-draft"]
    assert proposer_of("specdec-ngram-pipelined") == "ngram" and is_pipelined("specdec-ngram-pipelined@server")
    assert not is_pipelined("specdec-ngram")
    run, _ = choose_methods(["specdec-replay-pipelined"], have_draft=True, replay_alphas=(0.8,))
    assert run == ["specdec-replay-0.8", "specdec-replay-0.8-pipelined"]
    assert proposer_of("specdec-replay-0.8-pipelined") == "replay-0.8"
    assert "plain-calls" not in choose_methods(None, have_draft=True)[0]  # a diagnostic: opt-in
    assert choose_methods(["plain-calls", "plain"], have_draft=False)[0] == ["plain", "plain-calls"]
    assert "plain-again" not in choose_methods(None, have_draft=True)[0]  # the A/A control: opt-in
    assert choose_methods(["plain-again", "plain"], have_draft=False)[0] == ["plain", "plain-again"]
    assert is_service("plain-again") and "plain-again" not in SPECULATIVE
    run, _ = choose_methods(["plain", "specdec-draft"], have_draft=True, replay_alphas=(0.8,))
    assert run == ["plain", "specdec-draft", "specdec-replay-0.8"]
    assert proposer_of("specdec-replay-0.8") == "replay-0.8" and proposer_of("specdec-draft@server") == "draft-model"
    assert is_service("specdec-ngram@server") and base_name("specdec-ngram@server") == "specdec-ngram"
    with pytest.raises(ValueError, match="unknown methods"):
        choose_methods(["nope"], have_draft=True)
    with pytest.raises(ValueError, match="draft"):
        choose_methods(["plain"], have_draft=False, replay_alphas=(0.8,))
    run, _ = choose_methods(["plain", "specdec-replay-target"], have_draft=True, replay_alphas=(0.8,))
    assert run == ["plain", "specdec-replay-0.8", "specdec-replay-target-0.8"]
    assert proposer_of("specdec-replay-target-0.8") == "draft-model-target"
    with pytest.raises(ValueError, match="one --replay-alpha"):
        choose_methods(["specdec-replay-target"], have_draft=True, replay_alphas=(0.6, 0.8))


def test_refused_flags_are_one_line_errors_before_anything_starts(models, capsys):
    from specdec.cli import main

    target, draft = models
    base = ["bench", "--target", str(target), "--draft", str(draft)]
    assert main([*base, "--methods", "nonsense"]) == 2
    assert capsys.readouterr().err.startswith("specdec bench: error: unknown methods ['nonsense']; known: plain")
    assert main([*base, "--k-policy", "fixed:0"]) == 2
    assert "a fixed draft length is an integer >= 1, got 'fixed:0'" in capsys.readouterr().err
    for levels, message in (("0", "at least 1 session"), ("1,x", "comma-separated")):
        with pytest.raises(SystemExit) as refused:  # argparse's own exit: usage and the message
            main([*base, "--concurrency", levels])
        assert refused.value.code == 2 and message in capsys.readouterr().err


def test_a_spread_out_of_range_or_without_a_replay_alpha_is_refused(models):
    from specdec.bench.runner import Bench, BenchConfig

    target, draft = models
    with pytest.raises(ValueError, match="give --replay-alpha too"):
        Bench(BenchConfig(target=str(target), draft=str(draft), replay_alpha_spread=0.1))
    result = subprocess.run([sys.executable, "-m", "specdec.cli", "bench", "--replay-alpha", "0.8",
                             "--replay-alpha-spread", "1.5"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "the spread must be in [0, 1]" in result.stderr
