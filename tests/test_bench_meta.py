"""The benchmark report's record of the working tree (specdec/bench/meta.py)."""

from specdec.bench.meta import cpu_identity, specdec_env, tree_changes


def test_deleted_reports_are_counted_and_changed_code_is_listed():
    # _git strips its output, so the first line's leading blank is gone ("M path", not " M path").
    porcelain = "\n".join(["M specdec/models/llama.py", " D docs/bench/a.json", " D docs/bench/b.json",
                           " D specdec/data/drafts/x/model.safetensors", "MM tests/test_x.py", "A  new.py"])
    changes = tree_changes(porcelain)
    assert changes["modified_tracked_files"] == ["specdec/models/llama.py", "tests/test_x.py", "new.py"]
    assert changes["deleted_tracked_files"] == ["specdec/data/drafts/x/model.safetensors"]
    assert changes["deleted_docs_files"] == 2


def test_a_clean_tree_has_no_changes():
    assert tree_changes("") == {"modified_tracked_files": [], "deleted_tracked_files": [], "deleted_docs_files": 0}


def test_the_cpu_is_named_by_family_model_and_vector_extensions():
    cpuinfo = "\n".join(["processor\t: 0", "vendor_id\t: AuthenticAMD", "cpu family\t: 25", "model\t\t: 1",
                         "model name\t: AMD EPYC", "stepping\t: 1", "flags\t\t: fpu sse avx2 fma bmi2", "",
                         "processor\t: 1", "vendor_id\t: AuthenticAMD", "flags\t\t: fpu avx512f"])
    assert cpu_identity(cpuinfo) == {"vendor": "AuthenticAMD", "family": "25", "model": "1", "stepping": "1",
                                     "simd": ["avx2", "fma"]}  # the first CPU's block only
    assert cpu_identity("")["simd"] == []


def test_the_specdec_switches_of_the_run_are_recorded():
    environ = {"SPECDEC_LINEAR_KERNEL": "hybrid", "PATH": "/usr/bin", "SPECDEC_CPU_DECODE": "eager"}
    assert specdec_env(environ) == {"SPECDEC_CPU_DECODE": "eager", "SPECDEC_LINEAR_KERNEL": "hybrid"}
