"""Benchmark reports on disk: plain JSON or gzip-compressed (.json.gz, as kept in docs/bench)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from specdec.bench.output import recompute
from specdec.bench.report_file import plot_path, read_report, write_report

BENCH_DIR = Path(__file__).resolve().parents[1] / "docs" / "bench"


@pytest.mark.parametrize("name", ["report.json", "report.json.gz"])
def test_a_report_reads_back_as_written(tmp_path, name):
    report = {"schema": 3, "batch1": {"overall": {"plain": {"tokens_per_s": 51.25}}}, "text": "é"}
    path = tmp_path / name
    write_report(path, report)
    assert read_report(path) == report
    raw = path.read_bytes()
    if name.endswith(".gz"):
        assert json.loads(gzip.decompress(raw)) == report
    else:
        assert json.loads(raw) == report


def test_a_compressed_report_has_the_same_bytes_each_time(tmp_path):
    """No timestamp in the gzip header: rewriting an unchanged report changes nothing in git."""
    first, second = tmp_path / "a.json.gz", tmp_path / "b.json.gz"
    write_report(first, {"x": list(range(100))})
    write_report(second, {"x": list(range(100))})
    assert first.read_bytes() == second.read_bytes()


def test_the_default_plot_sits_beside_the_report():
    assert plot_path(Path("out/run.json")) == Path("out/run.png")
    assert plot_path(Path("out/run.json.gz")) == Path("out/run.png")


def test_the_kept_reports_are_compressed_and_recompute_to_their_numbers():
    """docs/bench holds reports as .json.gz only (uncompressed they passed what a GPU machine takes in
    one call), and the newest ones still recompute to the numbers they carry."""
    assert not list(BENCH_DIR.glob("*.json"))
    kept = sorted(BENCH_DIR.glob("cpu-round49-threads-*.json.gz"))
    assert kept
    for path in kept:
        report = read_report(path)
        stored = {method: values["tokens_per_s"] for method, values in report["batch1"]["overall"].items()
                  if "tokens_per_s" in values}  # (not "_step_times")
        assert "plain" in stored and "specdec-draft" in stored
        again = recompute(json.loads(json.dumps(report)))
        assert {method: again["batch1"]["overall"][method]["tokens_per_s"] for method in stored} == \
            pytest.approx(stored, rel=1e-9)
