"""Fingerprints: what produced a KV bundle, and whether a decode side may import it.

llama.cpp's state reader checks shapes but not identity: same-shaped weights of
another model load silently and give garbage, and the format has changed
between releases without a version field. So every bundle says what produced
it, and the importer refuses any difference, naming it.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from pathlib import Path

from ..errors import FingerprintMismatch

_CACHE_FILE = Path(os.environ.get("DISAGG_CACHE_DIR", Path.home() / ".cache" / "disaggregated-inference")) / "digests.json"
_lock = threading.Lock()
_BLOB = re.compile(r"^sha256-([0-9a-f]{64})$")

# Keys that must be equal on both sides; others (n_ctx, threads) are informative. A key is
# checked when either side has it: llama.cpp's ``model_sha256`` (the GGUF file), Ollama's
# ``ollama_model`` and ``model_digest`` (the digest ``/api/tags`` lists for that model).
MUST_MATCH = ("backend", "model_sha256", "library", "library_version", "arch", "n_layer", "n_embd",
              "type_k", "type_v", "flash_attn", "ollama_model", "model_digest")


def sha256_of(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes, read in 8 MiB blocks (no cache: see ``file_sha256``)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_sha256(path: str | os.PathLike, progress=lambda message: None) -> str:
    """SHA-256 of a model file, cached by (path, size, mtime) so restarts are instant.

    Ollama blobs are named after their digest, so theirs is read off the name.
    """
    path = Path(path).resolve()
    match = _BLOB.match(path.name)
    if match:
        return match.group(1)
    stat = path.stat()
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
    with _lock:
        cache = _read_cache()
        if key in cache:
            return cache[key]
    progress(f"hashing {path.name} ({stat.st_size / 1e9:.2f} GB, once)")
    value = sha256_of(path)
    with _lock:
        cache = _read_cache()
        cache[key] = value
        try:
            _CACHE_FILE.parent.mkdir(parents=True, exist_ok=True)
            tmp = _CACHE_FILE.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=0))
            tmp.replace(_CACHE_FILE)
        except OSError:
            pass  # a read-only home only costs a re-hash next time
    return value


def _read_cache() -> dict:
    try:
        return json.loads(_CACHE_FILE.read_text())
    except (OSError, ValueError):
        return {}


def differences(ours: dict, theirs: dict) -> list[str]:
    """Human-readable differences on the keys that must match."""
    diffs = []
    for key in MUST_MATCH:
        if key in ours or key in theirs:
            a, b = ours.get(key), theirs.get(key)
            if a != b:
                diffs.append(f"{key}: bundle has {b!r}, this server has {a!r}")
    return diffs


def check(ours: dict, theirs: dict) -> None:
    diffs = differences(ours, theirs)
    if diffs:
        raise FingerprintMismatch(
            "KV bundle was produced by a different model or setup: " + "; ".join(diffs),
            field="fingerprint", differences=diffs,
        )
