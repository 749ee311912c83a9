"""Find the GGUF file Ollama already pulled for a model name.

Layout (Ollama's manifest package): ``$OLLAMA_MODELS`` (default
``~/.ollama/models``) holds ``manifests/<host>/<namespace>/<name>/<tag>`` (JSON)
and ``blobs/sha256-<hex>``. The weights are the layer whose media type is
``application/vnd.ollama.image.model``; that blob is a GGUF file. Names match
without regard to case, as in Ollama.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelNotFound

DEFAULT_HOST = "registry.ollama.ai"
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class OllamaModel:
    name: str          # "name:tag" as ``ollama pull`` takes it, in the case it was pulled
    manifest: Path
    blob: Path         # the GGUF
    digest: str        # "sha256:<hex>"
    size: int


def models_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


def split_name(name: str) -> tuple[str, str, str, str]:
    """``qwen3-coder:30b`` -> (host, namespace, model, tag), Ollama's defaults filled in."""
    given = name
    name = name.strip()
    if name.startswith("ollama:"):
        name = name[len("ollama:"):]
    if not name:
        raise ModelNotFound("empty Ollama model name", field="model")
    rest, tag = name, "latest"
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        rest, tag = name.rsplit(":", 1)
    parts = rest.split("/")
    if not tag or not all(parts) or any(p in (".", "..") for p in (*parts, tag)):
        raise ModelNotFound(f"invalid Ollama model name {given!r} (expected [host/][namespace/]model[:tag])",
                            field="model")
    if len(parts) == 1:
        return DEFAULT_HOST, "library", parts[0], tag
    if len(parts) == 2:
        return DEFAULT_HOST, parts[0], parts[1], tag
    return parts[0], "/".join(parts[1:-1]), parts[-1], tag


def display_name(host: str, namespace: str, model: str, tag: str) -> str:
    """The shortest name ``ollama pull`` accepts for these parts."""
    if host != DEFAULT_HOST:
        return f"{host}/{namespace}/{model}:{tag}"
    return f"{model}:{tag}" if namespace == "library" else f"{namespace}/{model}:{tag}"


def _find(base: Path, parts: list[str]) -> Path | None:
    """``base/part/...``, each part matched without regard to case as Ollama does, or None."""
    path = base
    for part in parts:
        exact = path / part
        if exact.exists():
            path = exact
            continue
        try:
            path = next(p for p in path.iterdir() if p.name.lower() == part.lower())
        except (OSError, StopIteration):
            return None
    return path


def resolve(name: str, root: Path | None = None) -> OllamaModel:
    root = Path(root) if root else models_dir()
    host, namespace, model, tag = split_name(name)
    pretty = display_name(host, namespace, model, tag)
    manifest = _find(root / "manifests", [host, *namespace.split("/"), model, tag])
    if manifest is None or not manifest.is_file():
        raise ModelNotFound(
            f"Ollama model '{pretty}' is not pulled (no manifest under {root}; set OLLAMA_MODELS if Ollama keeps "
            f"its models elsewhere, e.g. /usr/share/ollama/.ollama/models for the Linux service); "
            f"run: ollama pull {pretty}",
            field="model", hint=f"ollama pull {pretty}",
        )
    try:
        layers = json.loads(manifest.read_text())["layers"]
        digest = next(layer for layer in layers if layer.get("mediaType") == MODEL_MEDIA_TYPE)["digest"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, StopIteration):
        raise ModelNotFound(f"Ollama manifest {manifest} has no model layer", field="model") from None
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise ModelNotFound(f"Ollama manifest {manifest} has a malformed model digest {digest!r}", field="model")
    blob = root / "blobs" / digest.replace(":", "-")
    if not blob.is_file():
        raise ModelNotFound(
            f"Ollama model '{pretty}' is missing its weights blob {blob.name}; run: ollama pull {pretty}",
            field="model", hint=f"ollama pull {pretty}",
        )
    found_host, *found_namespace, found_model, found_tag = manifest.relative_to(root / "manifests").parts
    name = display_name(found_host, "/".join(found_namespace), found_model, found_tag)  # the case on disk
    return OllamaModel(name, manifest, blob, digest, blob.stat().st_size)
