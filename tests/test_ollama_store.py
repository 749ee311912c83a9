"""Finding the GGUF Ollama pulled, on a real store layout built around the shipped SmolLM2 GGUF.

The store is what ``ollama pull`` leaves: ``manifests/<host>/<namespace>/<model>/<tag>``
(JSON) and ``blobs/sha256-<hex>`` named after each layer's real SHA-256. The
weights blob is a hard link to the packaged GGUF (a symlink where linking is
not allowed), so no copy is made.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from disaggregated_inference.kv import fingerprint
from disaggregated_inference.backends import ollama_store
from disaggregated_inference.errors import ModelNotFound
from disaggregated_inference.backends.gguf import resolve_gguf

from .conftest import TINY_THREADS
from .tiny_models import tiny_gguf

MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
TEMPLATE = "{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}<|im_start|>user\n{{ .Prompt }}"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Store:
    """An Ollama models directory: blobs named by digest, manifests naming them."""

    def __init__(self, root: Path):
        self.root = root
        (root / "blobs").mkdir(parents=True)
        (root / "manifests").mkdir()

    def blob_bytes(self, data: bytes) -> dict:
        hexdigest = hashlib.sha256(data).hexdigest()
        (self.root / "blobs" / f"sha256-{hexdigest}").write_bytes(data)
        return {"digest": f"sha256:{hexdigest}", "size": len(data)}

    def blob_file(self, source: Path, hexdigest: str) -> dict:
        target = self.root / "blobs" / f"sha256-{hexdigest}"
        try:
            os.link(source, target)
        except OSError:
            target.symlink_to(source)
        return {"digest": f"sha256:{hexdigest}", "size": source.stat().st_size}

    def manifest(self, parts: tuple[str, ...], layers: list[dict], config: dict | None = None) -> Path:
        path = self.root.joinpath("manifests", *parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        config = config or {"mediaType": "application/vnd.docker.container.image.v1+json",
                            **self.blob_bytes(b'{"model_format":"gguf","model_family":"llama"}')}
        path.write_text(json.dumps({"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "config": config,
                                    "layers": layers}))
        return path


@pytest.fixture(scope="module")
def gguf() -> tuple[Path, str]:
    """A llama GGUF with SmolLM2's vocabulary and chat template (the generated tiny one: quick to load)."""
    path = tiny_gguf("llama")
    return path, sha256_file(path)


@pytest.fixture(scope="module")
def store(tmp_path_factory, gguf) -> Store:
    """smollm2-test:latest, smollm2-test:q4, someone/smol:v1 and hf.co/someone/smol-gguf:Q4_1, one blob."""
    path, hexdigest = gguf
    s = Store(tmp_path_factory.mktemp("ollama") / "models")
    weights = {"mediaType": "application/vnd.ollama.image.model", **s.blob_file(path, hexdigest)}
    template = {"mediaType": "application/vnd.ollama.image.template", **s.blob_bytes(TEMPLATE.encode())}
    params = {"mediaType": "application/vnd.ollama.image.params",
              **s.blob_bytes(b'{"stop":["<|im_end|>"]}')}
    for parts in [("registry.ollama.ai", "library", "smollm2-test", "latest"),
                  ("registry.ollama.ai", "library", "smollm2-test", "q4"),
                  ("registry.ollama.ai", "someone", "smol", "v1"),
                  ("hf.co", "someone", "smol-gguf", "Q4_1")]:
        s.manifest(parts, [weights, template, params])
    return s


@pytest.mark.parametrize("name, pretty, parts", [
    ("smollm2-test", "smollm2-test:latest", ("registry.ollama.ai", "library", "smollm2-test", "latest")),
    ("smollm2-test:latest", "smollm2-test:latest", ("registry.ollama.ai", "library", "smollm2-test", "latest")),
    ("ollama:smollm2-test:q4", "smollm2-test:q4", ("registry.ollama.ai", "library", "smollm2-test", "q4")),
    ("library/smollm2-test", "smollm2-test:latest", ("registry.ollama.ai", "library", "smollm2-test", "latest")),
    ("someone/smol:v1", "someone/smol:v1", ("registry.ollama.ai", "someone", "smol", "v1")),
    ("hf.co/someone/smol-gguf:Q4_1", "hf.co/someone/smol-gguf:Q4_1", ("hf.co", "someone", "smol-gguf", "Q4_1")),
    ("SmolLM2-Test:Q4", "smollm2-test:q4", ("registry.ollama.ai", "library", "smollm2-test", "q4")),
])
def test_resolves_names_to_the_weights_blob(store, gguf, name, pretty, parts):
    path, hexdigest = gguf
    found = ollama_store.resolve(name, store.root)
    assert found.blob == store.root / "blobs" / f"sha256-{hexdigest}"
    assert found.blob.read_bytes()[:4] == b"GGUF"
    assert found.digest == f"sha256:{hexdigest}" and found.size == path.stat().st_size
    assert found.manifest == store.root.joinpath("manifests", *parts)
    assert found.name == pretty


def test_split_name_fills_in_ollamas_defaults():
    assert ollama_store.split_name("qwen3-coder:30b") == ("registry.ollama.ai", "library", "qwen3-coder", "30b")
    assert ollama_store.split_name("llama3") == ("registry.ollama.ai", "library", "llama3", "latest")
    assert ollama_store.split_name("localhost:5000/ns/m") == ("localhost:5000", "ns", "m", "latest")


@pytest.mark.parametrize("name, pull", [
    ("qwen3-coder:30b", "qwen3-coder:30b"),
    ("smollm2-test:fp16", "smollm2-test:fp16"),
    ("nobody/smol", "nobody/smol:latest"),
    ("hf.co/nobody/x-gguf:Q8_0", "hf.co/nobody/x-gguf:Q8_0"),
])
def test_a_name_that_is_not_pulled_says_how_to_pull_it(store, name, pull):
    with pytest.raises(ModelNotFound) as info:
        ollama_store.resolve(name, store.root)
    assert f"ollama pull {pull}" in info.value.message and info.value.details["hint"] == f"ollama pull {pull}"
    assert str(store.root) in info.value.message and "OLLAMA_MODELS" in info.value.message
    assert info.value.status == 404


@pytest.mark.parametrize("name", ["", "ollama:", "model:", "a//b", "../../etc:passwd"])
def test_malformed_names_are_refused(store, name):
    with pytest.raises(ModelNotFound):
        ollama_store.resolve(name, store.root)


def test_a_missing_blob_says_to_pull_again(store):
    store.manifest(("registry.ollama.ai", "library", "halfpulled", "latest"),
                   [{"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:" + "0" * 64, "size": 1}])
    with pytest.raises(ModelNotFound) as info:
        ollama_store.resolve("halfpulled", store.root)
    assert "sha256-" + "0" * 64 in info.value.message and "ollama pull halfpulled:latest" in info.value.message


@pytest.mark.parametrize("manifest, says", [
    ("not json", "no model layer"),
    (json.dumps({"schemaVersion": 2, "layers": []}), "no model layer"),
    (json.dumps({"schemaVersion": 2, "layers": [{"mediaType": "application/vnd.ollama.image.model"}]}),
     "no model layer"),
    (json.dumps({"schemaVersion": 2, "layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                 "digest": "sha256:../../../etc/passwd"}]}), "malformed"),
])
def test_a_broken_manifest_is_reported(store, manifest, says):
    path = store.root / "manifests" / "registry.ollama.ai" / "library" / "broken" / "latest"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(manifest)
    with pytest.raises(ModelNotFound) as info:
        ollama_store.resolve("broken", store.root)
    assert says in info.value.message


def test_models_dir_follows_ollama_models_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "elsewhere"))
    assert ollama_store.models_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("OLLAMA_MODELS")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ollama_store.models_dir() == tmp_path / ".ollama" / "models"


def test_resolve_gguf_finds_an_ollama_model_through_ollama_models(store, gguf, monkeypatch):
    _, hexdigest = gguf
    monkeypatch.setenv("OLLAMA_MODELS", str(store.root))
    said = []
    path = resolve_gguf("ollama:smollm2-test", said.append)
    assert path == store.root / "blobs" / f"sha256-{hexdigest}"
    assert said == [f"using Ollama's pulled blob for smollm2-test:latest: sha256-{hexdigest}"]
    # the fingerprint of an Ollama blob is read off its name, and it is the file's real digest
    assert fingerprint.file_sha256(path) == hexdigest
    with pytest.raises(ModelNotFound, match="ollama pull smollm2-test:fp16"):
        resolve_gguf("ollama:smollm2-test:fp16")


def test_resolve_gguf_refuses_a_blob_that_is_not_gguf(store, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(store.root))
    layer = {"mediaType": "application/vnd.ollama.image.model", **store.blob_bytes(b"not a gguf file at all")}
    store.manifest(("registry.ollama.ai", "library", "notgguf", "latest"), [layer])
    with pytest.raises(ModelNotFound, match="not a GGUF file"):
        resolve_gguf("ollama:notgguf")


def _llama_cpp_imports() -> bool:
    """In a child process: a broken llama_cpp build may crash the importer, not just raise."""
    return subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True, timeout=120).returncode == 0


@pytest.mark.slow
def test_a_real_kv_handoff_on_the_gguf_ollama_pulled(store, gguf, tmp_path):
    """llama_cpp servers load ``ollama:NAME`` from the store and hand the KV cache over."""
    if not _llama_cpp_imports():
        pytest.skip("llama_cpp does not import here")
    import requests

    from disaggregated_inference.ops.cluster import LocalCluster

    _, hexdigest = gguf
    config = {
        "models": {"smol": {"backend": "llama_cpp", "model": "ollama:smollm2-test", "n_ctx": 2048,
                            "n_threads": TINY_THREADS}},
        "prefill_servers": [{"name": "ollama-prefill", "host": "127.0.0.1", "port": 1, "model": "smol"}],
        "decode_servers": [{"name": "ollama-decode", "host": "127.0.0.1", "port": 2, "model": "smol"}],
    }
    with LocalCluster(config, free_ports=True, log_dir=tmp_path, env={"OLLAMA_MODELS": str(store.root)}) as cluster:
        cluster.wait_healthy(timeout=300)
        prefill_url, decode_url = (cluster.process(n).url for n in ("ollama-prefill", "ollama-decode"))
        health = requests.get(f"{prefill_url}/health", timeout=5).json()
        assert health["model_info"]["model_file"] == str(store.root / "blobs" / f"sha256-{hexdigest}")
        pre = requests.post(f"{prefill_url}/prefill", json={"prompt": "Name three colours."}, timeout=60).json()
        assert pre["handoff"] == "llama_seq_state" and pre["fingerprint"]["model_sha256"] == hexdigest
        out = requests.post(f"{decode_url}/decode", json={"kv": pre["kv"], "max_new_tokens": 16}, timeout=120).json()
        assert out["metrics"]["method"] == "kv_handoff" and out["metrics"]["prompt_tokens_recomputed"] == 1
        mono = requests.post(f"{decode_url}/generate", json={"prompt": "Name three colours.", "max_new_tokens": 16},
                             timeout=120).json()
        assert out["generated_text"] == mono["generated_text"] and out["generated_text"]
