"""Attention of decode and verify tokens on a CPU: one compiled loop over (query token, KV head) items (numba).

A batched CPU step of the default target (16 sessions, one decode token each, 200-400 keys) spent
about 40 of its 114 ms in attention: PyTorch's SDPA kernel is built for long query blocks, and for a
one-token query it reads the keys and values at about a third of the machine's memory bandwidth
(the cache of 16 sessions is ~220 MB a step, far past the caches). Batched matrix products do no
better for these shapes (MKL's small-matrix paths). This loop reads each key and value row once per
KV head for all the query heads that share it (grouped-query attention), with the dot products
vectorised: 20 ms for the same step's 30 layers (docs/BENCHMARKS.md, round 30).

Each query token is attended on its own, over its slot's keys up to its own position (key_lens), so a
verify row's causal mask is just each token's length, rows may come from any slots in any order,
and within one build a token's result does not depend on what else is in the batch. The arithmetic is float32 with
the dot products and sums reassociated for vectorisation (fastmath without the approximate-function
and finite-math flags): it differs from SDPA's in the last bits only (tests/test_cpu_attention.py).

On more than one intra-op thread a parallel build splits the items over the calling thread's
threads (numba's OpenMP layer, which links the system's libgomp: a runtime and a worker of its own
beside the one PyTorch bundles, while PyTorch's worker would spin idle through the attention). A 16-session step of the default target on two cores: 40 -> 34.5 ms (round 48). In
the parallel build an item's bits do not depend on the thread count or the batch. Both builds call
one compiled function per item and in every check here gave the same bits, but LLVM may re-optimise
it where it inlines it, so the two are only promised to agree to float32 rounding: a batch-invariant
model (whose one-token steps must give a verify's bits) keeps the serial build (attend's split).

numba compiles the loop when a model first asks for it (about a second; loaded from a disk cache,
NUMBA_CACHE_DIR or a directory per version of these loops' sources under ~/.cache/specdec/numba, in
about 0.3 s after that). Without numba installed, available() is False and the model keeps SDPA.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import types
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

# Rows longer than this (prefills) keep SDPA: a per-token loop re-reads the keys for every query,
# where SDPA's blocked kernel reuses them across a long block.
MAX_QUERY_TOKENS = 16
# Round 30's single-threaded loop matched SDPA at two intra-op threads (16 rows: 61 against 64 ms a
# step), and its parallel build beats it there; above two threads (not measured here) SDPA keeps it.
MAX_THREADS = 2
# Vectorised sums need reassociation; no approximate exp, no assumption that values are finite.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


# The files whose compiled loops call one another: numba inlines a callee into its caller's cached
# build but keys that build on the caller's file alone (its path, size and modification time).
KERNEL_SOURCES = ("cpu_attention.py", "cpu_decode.py", "cpu_linear.py", "cpu_scores.py")


def default_cache_dir(root: str | None = None) -> str:
    """numba's disk cache for these loops (where NUMBA_CACHE_DIR is not set): a directory per version of
    KERNEL_SOURCES. One shared directory kept, after a change to cpu_attention's loop alone, the old
    attention inside cpu_decode's cached draft step, because cpu_decode.py itself had not changed (a
    `git pull` keeps an untouched file's modification time)."""
    digest = hashlib.sha256()
    for name in KERNEL_SOURCES:
        digest.update(Path(__file__).with_name(name).read_bytes())
    root = root or os.path.join(os.path.expanduser("~"), ".cache", "specdec", "numba")
    return os.path.join(root, digest.hexdigest()[:16])


_VERSION_DIR = re.compile(r"[0-9a-f]{16}")  # default_cache_dir's names
_LEGACY_DIR = re.compile(r"\w+_[0-9a-f]{40}")  # numba's per-source-folder directories, once at the root


def prune_cache_dirs(current: str, keep: int = 2) -> list[str]:
    """Delete the directories of older versions beside `current` (a default_cache_dir), all but the
    `keep` most recently written, and the builds left at the root by releases before the versioned
    layout (numba's `<package>_<path hash>` folders); return what was deleted. About 1 MB a version
    otherwise piles up with every update. A process still running an old version loses nothing: its
    builds are loaded, and numba writes a missing directory anew. Other names are left alone."""
    root = os.path.dirname(current)
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    versions = [e for e in entries if e.is_dir() and e.path != current and _VERSION_DIR.fullmatch(e.name)]
    versions.sort(key=lambda e: e.stat().st_mtime, reverse=True)
    legacy = [e for e in entries if e.is_dir() and _LEGACY_DIR.fullmatch(e.name)]
    deleted = []
    for entry in versions[keep:] + legacy:
        shutil.rmtree(entry.path, ignore_errors=True)
        deleted.append(entry.path)
    return deleted


# Before numba is first imported: numba reads its cache directory when it is imported (and again at
# each compile), and a function decorated before that re-read was filed in the package's __pycache__.
_DEFAULT_CACHE_DIR = default_cache_dir()
os.environ.setdefault("NUMBA_CACHE_DIR", _DEFAULT_CACHE_DIR)

try:
    from numba import prange
except ImportError:  # no numba: the loop is never compiled, and prange only has to exist
    prange = range


_item = None  # _attend_item compiled, called by both builds of _attend_items (set by _kernel)


def _attend_item(q, keys, values, t, kv, slot, length, scale, out):  # pragma: no cover - compiled
    # Query token t's heads that share KV head kv, over slot's first `length` keys. One compiled function
    # for both builds of _attend_items: with the loop written into each, the two vectorised it
    # differently (outputs 1 ulp apart).
    groups = q.shape[1] // keys.shape[1]
    dim = q.shape[2]
    first = kv * groups  # query heads first .. first + groups - 1 read this KV head
    scores = np.empty((groups, length), dtype=np.float32)
    for pos in range(length):
        for g in range(groups):
            acc = np.float32(0.0)
            for d in range(dim):
                acc += q[t, first + g, d] * keys[slot, kv, pos, d]
            scores[g, pos] = acc * scale
    for g in range(groups):
        top = scores[g, 0]
        for pos in range(1, length):
            top = max(top, scores[g, pos])
        total = np.float32(0.0)
        for pos in range(length):
            weight = np.exp(scores[g, pos] - top)
            scores[g, pos] = weight
            total += weight
        for pos in range(length):
            scores[g, pos] /= total
        for d in range(dim):
            out[t, first + g, d] = 0.0
    for pos in range(length):
        for g in range(groups):
            weight = scores[g, pos]
            for d in range(dim):
                out[t, first + g, d] += weight * values[slot, kv, pos, d]


def _attend_items(q, keys, values, slots, key_lens, scale, out):  # pragma: no cover - compiled
    # q [N, H, D]; keys/values [slots, KV, ctx + 1, D]; out [N, H, D]. One item is a query token and one
    # KV head (the query heads that share it), all of its arithmetic on one thread in one order: its
    # bits do not depend on the thread count or on the other items.
    kv_heads = keys.shape[1]
    for item in prange(q.shape[0] * kv_heads):  # the parallel build splits the items over the threads
        t = item // kv_heads
        _item(q, keys, values, t, item - t * kv_heads, slots[t], key_lens[t], scale, out)


@functools.cache
def _kernel(parallel: bool = False):
    """_attend_items compiled (or loaded from the disk cache), or None without numba. parallel: the
    build that splits the items over numba's threads, compiled for the serial build's argument types
    but not run (see parallel_layer_ready)."""
    try:
        import numba
    except ImportError:
        return None
    numba.core.config.reload_config()  # NUMBA_CACHE_DIR, where numba was imported before this module
    if parallel:
        return parallel_build(_attend_items, _kernel(), "the compiled CPU attention")
    if os.environ.get("NUMBA_CACHE_DIR") == _DEFAULT_CACHE_DIR:  # ours: a user's own directory is theirs
        for path in prune_cache_dirs(_DEFAULT_CACHE_DIR):
            log.info("removed the compiled CPU loops of an older version: %s", path)
    global _item
    _item = numba.njit(nogil=True, cache=True, fastmath=FASTMATH, boundscheck=False)(_attend_item)
    attend = numba.njit(nogil=True, cache=True, fastmath=FASTMATH, boundscheck=False)(_attend_items)
    # Compile (or load from the disk cache) now, at model load, not in a session's first step.
    cache = np.zeros((1, 1, 2, 4), dtype=np.float32)
    try:
        attend(np.zeros((1, 1, 4), dtype=np.float32), cache, cache, np.zeros(1, dtype=np.int64),
               np.ones(1, dtype=np.int64), np.float32(0.5), np.zeros((1, 1, 4), dtype=np.float32))
    except Exception as exc:  # noqa: BLE001 - a broken numba install must not stop a model loading
        log.warning("the compiled CPU attention did not compile (%r); attention stays on SDPA", exc)
        return None
    return attend


def parallel_build(source, serial, what: str):
    """The parallel build of a loop whose serial build is `serial` (None: none either), compiled for
    its argument types without running it; None if it does not compile. Compiling starts numba's
    threading layer, which set the calling thread's PyTorch thread count to numba's: it is put back,
    or this (loading) thread's next products (a hosted draft's calibration) would run on two threads
    and leave a team here (in round 48 that slowed the target's one-token step in its service from
    15 to 23 ms; loader.on_own_thread says why)."""
    if serial is None:
        return None
    import numba

    # A name of its own: numba's disk cache files a function's builds by its name, not its flags.
    name = f"{source.__name__}_parallel"
    renamed = types.FunctionType(source.__code__, source.__globals__, name)
    renamed.__qualname__ = name
    build = numba.njit(nogil=True, cache=True, fastmath=FASTMATH, boundscheck=False, parallel=True)(renamed)
    threads = torch.get_num_threads()
    try:
        for signature in serial.signatures:
            build.compile(signature)
    except Exception as exc:  # noqa: BLE001 - a broken numba install must not stop a model loading
        log.warning("%s's parallel build did not compile (%r)", what, exc)
        return None
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
    return build


@functools.cache
def parallel_layer_ready() -> bool:
    """Start numba's threading layer on the calling thread, once; True if it is OpenMP or TBB.

    Call it only from the thread that runs the model's forwards. An OpenMP team lives as long as the
    thread that started it, and with more OpenMP threads than cores libgomp stops spin-waiting between
    parallel regions (loader.on_own_thread); started on the loading thread, numba's team would stay
    there beside the model thread's. The fallback layer, "workqueue", aborts when two threads launch
    parallel loops at once, and a service may run models on more than one thread: no parallel builds
    then."""
    import numba

    numba.get_num_threads()  # launches the layer
    return numba.threading_layer() in ("omp", "tbb")


def available() -> bool:
    """True where numba is installed and the loop compiled (else the model keeps SDPA)."""
    return _kernel() is not None


def prepare_parallel() -> bool:
    """Compile the parallel build now (a model that will run forwards on more than one thread calls
    this at load; nothing runs, so numba's threads do not start on the loading thread); False where
    there is none."""
    return _kernel(True) is not None


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: np.ndarray,
           key_lens: np.ndarray, split: bool = True) -> torch.Tensor:
    """q [tokens, H, D] float32; keys/values [slots, KV, ctx + 1, D] (a layer of the cache); token i
    attends to the first key_lens[i] keys of slot slots[i]. Returns [tokens, H * D].

    split: on more than one intra-op thread, forwards of two tokens or more go through the parallel
    build (a lone decode token has only KV-heads items, too few to split evenly; the build's launch
    costs about 0.3 ms a step). False: always the serial build. SPECDEC_CPU_ATTENTION=serial keeps the
    serial build (an A/B switch)."""
    tokens, heads, dim = q.shape
    q = q.contiguous()
    out = torch.empty(tokens, heads, dim, dtype=q.dtype)
    threads = torch.get_num_threads()
    kernel = _kernel()
    if (split and threads > 1 and tokens > 1 and os.environ.get("SPECDEC_CPU_ATTENTION") != "serial"
            and _kernel(True) is not None and parallel_layer_ready()):
        import numba

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))  # per calling thread
        kernel = _kernel(True)
    kernel(q.numpy(), keys.numpy(), values.numpy(), slots, key_lens, np.float32(dim ** -0.5), out.numpy())
    return out.view(tokens, heads * dim)


def query_layout(slots, starts, lengths) -> tuple[np.ndarray, np.ndarray]:
    """Per query token, packed row after row: its slot, and how many keys it attends (its position + 1)."""
    token_slots = np.repeat(np.asarray(slots, dtype=np.int64), lengths)
    key_lens = np.concatenate([np.arange(start + 1, start + n + 1, dtype=np.int64)
                               for start, n in zip(starts, lengths)])
    return token_slots, key_lens
