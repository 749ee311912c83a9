"""Tiny production-architecture GGUFs, generated at test time (no downloads).

The production cluster runs ``qwen3-coder:30b`` (architecture ``qwen3moe``: mixture of
experts, grouped-query attention, per-head Q/K norms) and ``gpt-oss:120b`` (architecture
``gpt-oss``: mixture of experts with biased experts, alternating sliding-window and full
attention, attention sinks). ``tiny_gguf(arch)`` writes a GGUF of that architecture with the
metadata keys and tensor names/shapes that llama.cpp's loader (the version vendored in
llama-cpp-python 0.3.36) requires, random weights of tiny dimensions, and the real tokenizer
block of the shipped SmolLM2 GGUF (vocabulary, merges, special ids, chat template), with the
``gguf`` package llama.cpp's own converter uses. ``vocab="harmony"`` adds gpt-oss's harmony
special tokens to that vocabulary (control tokens, ``<|return|>`` the end-of-sequence token, as
in a gpt-oss GGUF) and a harmony chat template: ``GPT_OSS_HARMONY`` is the production
architecture speaking gpt-oss's format, ``LLAMA_HARMONY`` a llama that does (for the engines that
run llama only), recognised by its template. A file takes about a second to write and is
cached under ``$DISAGG_CACHE_DIR/tiny-models`` (default ``~/.cache/disaggregated-inference``),
named by a hash of everything that goes into it.

Shapes follow the loader (``create_tensor`` calls in llama.cpp's ``src/llama-model.cpp``; gguf's
``(ne0, ne1, ...)`` order, so a ``{n_embd, n_q}`` matrix is a numpy array of shape ``(n_q, n_embd)``).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

GENERATOR_VERSION = 1


@dataclass(frozen=True)
class TinyShape:
    arch: str            # "llama" (the tests' fast stand-in), "qwen3moe" or "gpt-oss"
    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2   # grouped-query attention, as both production models
    head_dim: int = 32   # != n_embd / n_head, as in both production models
    n_expert: int = 4
    n_expert_used: int = 2
    n_ff_exp: int = 64
    n_swa: int = 0       # gpt-oss: sliding window of every other layer (0: none)
    context_length: int = 4096
    expert_type: str = "f16"  # gpt-oss: "mxfp4", the experts' type in llama.cpp's conversion of gpt-oss
    seed: int = 0
    vocab: str = "smollm2"    # or "harmony": SmolLM2's plus gpt-oss's harmony tokens and template

    def kv_bytes_per_token(self, layers: int | None = None, bytes_per_value: int = 2) -> int:
        """K and V of one token in ``layers`` layers (default all), at f16 by default."""
        layers = self.n_layer if layers is None else layers
        return layers * self.n_head_kv * self.head_dim * 2 * bytes_per_value

    @property
    def swa_layers(self) -> list[int]:
        """gpt-oss's pattern (llama.cpp ``set_swa_pattern(2)``): even layers slide, odd ones see everything."""
        return [i for i in range(self.n_layer) if i % 2 == 0] if self.n_swa else []


# A dense llama of two layers: a step of a few sequences takes about a millisecond, so the tests of the
# protocol, trust, limits, failover, gateway and ops run real servers without waiting on a model.
LLAMA = TinyShape(arch="llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_expert=0,
                  n_expert_used=0, n_ff_exp=128)
QWEN3MOE = TinyShape(arch="qwen3moe")
GPT_OSS = TinyShape(arch="gpt-oss", n_swa=128, expert_type="mxfp4")
GPT_OSS_HARMONY = replace(GPT_OSS, vocab="harmony")
LLAMA_HARMONY = replace(LLAMA, vocab="harmony")
SHAPES = {"llama": LLAMA, "qwen3moe": QWEN3MOE, "gpt-oss": GPT_OSS}

# gpt-oss's special tokens of harmony (their ids in gpt-oss's o200k_harmony vocabulary in the comments); the tiny
# vocabulary appends them after SmolLM2's 49,152 tokens, as control tokens
HARMONY_TOKENS = ("<|return|>",     # 200002: ends a generation (the answer is complete)
                  "<|constrain|>",  # 200003: the type of a tool call's arguments follows
                  "<|channel|>",    # 200005: the message's channel follows
                  "<|start|>",      # 200006: a message begins; its role follows
                  "<|end|>",        # 200007: a message ends (not the generation)
                  "<|message|>",    # 200008: the header ends, the text begins
                  "<|call|>")       # 200012: ends a generation with a tool call
# a harmony template of the tests' own: enough for a GGUF to say it speaks harmony (its markers), and to
# render plain turns; the engines render harmony themselves (chat/harmony.py)
HARMONY_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}<|end|>"
    "{%- else -%}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")


def cache_dir() -> Path:
    base = os.environ.get("DISAGG_CACHE_DIR") or Path.home() / ".cache" / "disaggregated-inference"
    return Path(base) / "tiny-models"


def tiny_gguf(arch: str | TinyShape) -> Path:
    """Path of the tiny GGUF for ``arch`` (a name in SHAPES or a TinyShape), written if not cached."""
    shape = SHAPES[arch] if isinstance(arch, str) else arch
    tokenizer_source = _tokenizer_source()
    described = asdict(shape)
    if shape.vocab == "smollm2":  # the files made before the field existed keep their names
        del described["vocab"]
    key = json.dumps({"v": GENERATOR_VERSION, "shape": described, "tokenizer": tokenizer_source.name,
                      "tokenizer_size": tokenizer_source.stat().st_size}, sort_keys=True)
    name = shape.arch if shape.vocab == "smollm2" else f"{shape.arch}-{shape.vocab}"
    path = cache_dir() / f"tiny-{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        _write(shape, tokenizer_source, tmp)
        tmp.replace(path)  # atomic: parallel test processes never see half a file
    return path


def _tokenizer_source() -> Path:
    from disaggregated_inference.backends.gguf import resolve_gguf

    return resolve_gguf("smollm2")


def _copy_tokenizer(source: Path, writer, vocab: str = "smollm2") -> int:
    """Copy every ``tokenizer.*`` key of ``source`` into ``writer`` (with harmony's tokens, end of sequence and
    template for ``vocab="harmony"``); returns the vocabulary size."""
    import gguf

    reader = gguf.GGUFReader(source)
    n_vocab = 0
    n_source = len(reader.fields["tokenizer.ggml.tokens"].contents())
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        main = field.types[0]
        sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        if vocab == "harmony":
            if key == "tokenizer.ggml.tokens":
                value = list(value) + list(HARMONY_TOKENS)
            elif key == "tokenizer.ggml.token_type":
                value = list(value) + [gguf.TokenType.CONTROL] * len(HARMONY_TOKENS)
            elif key == "tokenizer.ggml.eos_token_id":
                value = n_source + HARMONY_TOKENS.index("<|return|>")
            elif key == "tokenizer.chat_template":
                value = HARMONY_TEMPLATE
        writer.add_key_value(key, value, main, sub_type=sub)
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(value)
    return n_vocab


def _write(shape: TinyShape, tokenizer_source: Path, out: Path) -> None:
    import gguf

    arch = shape.arch
    rng = np.random.default_rng(shape.seed)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"tiny-{arch} (random weights, for tests)")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff_exp)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-6 if arch == "qwen3moe" else 1e-5)
    if shape.n_expert:
        writer.add_expert_count(shape.n_expert)
        writer.add_expert_used_count(shape.n_expert_used)
        writer.add_expert_feed_forward_length(shape.n_ff_exp)
    if arch == "llama":
        writer.add_rope_freq_base(1e5)  # SmolLM2's, whose tokenizer it carries
    elif arch == "qwen3moe":
        writer.add_rope_freq_base(1e7)  # qwen3-coder's
    elif arch == "gpt-oss":
        writer.add_rope_freq_base(150000.0)
        writer.add_sliding_window(shape.n_swa)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(32.0)
        writer.add_rope_scaling_orig_ctx_len(shape.context_length)
    else:
        raise ValueError(f"no tiny generator for architecture {arch!r}")
    n_vocab = _copy_tokenizer(tokenizer_source, writer, shape.vocab)

    def add(name: str, *ne: int, dtype=np.float16, scale: float = 0.1, value: float | None = None):
        shape_np = tuple(reversed(ne))  # gguf's ne0 is numpy's last axis
        data = (np.full(shape_np, value) if value is not None else rng.normal(0.0, scale, shape_np)).astype(dtype)
        writer.add_tensor(name, data)

    def add_expert(name: str, *ne: int):
        if shape.expert_type == "f16":
            return add(name, *ne)
        qtype = {"mxfp4": gguf.GGMLQuantizationType.MXFP4}[shape.expert_type]
        data = gguf.quants.quantize(rng.normal(0.0, 0.1, tuple(reversed(ne))).astype(np.float32), qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)

    e, q, kv, ff, x = (shape.n_embd, shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim,
                       shape.n_ff_exp, shape.n_expert)
    f32 = np.float32
    add("token_embd.weight", e, n_vocab, scale=1.0)
    add("output_norm.weight", e, dtype=f32, value=1.0)
    add("output.weight", e, n_vocab)
    for i in range(shape.n_layer):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", e, dtype=f32, value=1.0)
        add(b + "attn_q.weight", e, q)
        add(b + "attn_k.weight", e, kv)
        add(b + "attn_v.weight", e, kv)
        add(b + "attn_output.weight", q, e)
        if arch == "llama":  # a dense feed-forward block
            add(b + "ffn_norm.weight", e, dtype=f32, value=1.0)
            add(b + "ffn_gate.weight", e, ff)
            add(b + "ffn_up.weight", e, ff)
            add(b + "ffn_down.weight", ff, e)
            continue
        add(b + "ffn_gate_inp.weight", e, x, dtype=f32)
        add_expert(b + "ffn_gate_exps.weight", e, ff, x)
        add_expert(b + "ffn_up_exps.weight", e, ff, x)
        add_expert(b + "ffn_down_exps.weight", ff, e, x)
        if arch == "qwen3moe":
            add(b + "attn_q_norm.weight", shape.head_dim, dtype=f32, value=1.0)
            add(b + "attn_k_norm.weight", shape.head_dim, dtype=f32, value=1.0)
            add(b + "ffn_norm.weight", e, dtype=f32, value=1.0)
        else:  # gpt-oss: a post-attention norm, sinks, and biases everywhere
            add(b + "post_attention_norm.weight", e, dtype=f32, value=1.0)
            add(b + "attn_sinks.weight", shape.n_head, dtype=f32)
            add(b + "attn_q.bias", q, dtype=f32)
            add(b + "attn_k.bias", kv, dtype=f32)
            add(b + "attn_v.bias", kv, dtype=f32)
            add(b + "attn_output.bias", e, dtype=f32)
            add(b + "ffn_gate_inp.bias", x, dtype=f32)
            add(b + "ffn_gate_exps.bias", ff, x, dtype=f32)
            add(b + "ffn_up_exps.bias", ff, x, dtype=f32)
            add(b + "ffn_down_exps.bias", e, x, dtype=f32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# -- Ollama stores shaped like the production ones -------------------------------------------------

MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_TYPE = "application/vnd.docker.container.image.v1+json"
# What Ollama 0.12+ stores next to the weights of the two production models (contents abridged,
# media types and layer order as ``ollama pull`` writes them).
PRODUCTION = {
    "qwen3-coder:30b": {
        "arch": "qwen3moe", "model_type": "30.5B", "file_type": "Q4_K_M",
        "template": "{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
                    "<|im_start|>user\n{{ .Prompt }}<|im_end|>\n<|im_start|>assistant\n",
        "license": "Apache License Version 2.0, January 2004 (abridged)",
        "params": {"repeat_penalty": 1.05, "stop": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
                   "temperature": 0.7, "top_k": 20, "top_p": 0.8},
    },
    "gpt-oss:120b": {
        "arch": "gpt-oss", "model_type": "116.8B", "file_type": "MXFP4",
        "template": "<|start|>system<|message|>{{ .System }}<|end|>{{ range .Messages }}"
                    "<|start|>{{ .Role }}<|message|>{{ .Content }}<|end|>{{ end }}<|start|>assistant",
        "license": "Apache License Version 2.0, January 2004 (abridged)",
        "params": {"temperature": 1},
    },
}


def write_ollama_store(root: Path) -> dict[str, str]:
    """An Ollama models directory holding the production names, the tiny GGUFs as their model layers.

    Returns ``{name: "sha256:<hex>"}`` of each model layer. Blobs are named after their real SHA-256,
    as Ollama names them; the weights blob is a hard link to the cached tiny GGUF (a copy where
    links are not allowed).
    """
    import shutil

    root = Path(root)
    (root / "blobs").mkdir(parents=True, exist_ok=True)

    def blob(data: bytes | None = None, source: Path | None = None) -> dict:
        hexdigest = hashlib.sha256(data if data is not None else source.read_bytes()).hexdigest()
        target = root / "blobs" / f"sha256-{hexdigest}"
        if not target.exists():
            if data is not None:
                target.write_bytes(data)
            else:
                try:
                    os.link(source, target)
                except OSError:
                    shutil.copyfile(source, target)
        return {"digest": f"sha256:{hexdigest}", "size": target.stat().st_size}

    digests = {}
    for name, spec in PRODUCTION.items():
        model = {"mediaType": "application/vnd.ollama.image.model", **blob(source=tiny_gguf(spec["arch"]))}
        layers = [model,
                  {"mediaType": "application/vnd.ollama.image.template", **blob(spec["template"].encode())},
                  {"mediaType": "application/vnd.ollama.image.license", **blob(spec["license"].encode())},
                  {"mediaType": "application/vnd.ollama.image.params", **blob(json.dumps(spec["params"]).encode())}]
        config = {"model_format": "gguf", "model_family": spec["arch"], "model_families": [spec["arch"]],
                  "model_type": spec["model_type"], "file_type": spec["file_type"], "architecture": "amd64",
                  "os": "linux", "rootfs": {"type": "layers", "diff_ids": [layer["digest"] for layer in layers]}}
        model_name, tag = name.split(":")
        manifest = root / "manifests" / "registry.ollama.ai" / "library" / model_name / tag
        manifest.parent.mkdir(parents=True, exist_ok=True)
        manifest.write_text(json.dumps({
            "schemaVersion": 2, "mediaType": MANIFEST_TYPE,
            "config": {"mediaType": CONFIG_TYPE, **blob(json.dumps(config).encode())}, "layers": layers}))
        digests[name] = model["digest"]
    return digests


def tiny_cluster_config(parallel: int = 2, n_ctx: int = 4096, n_threads: int = 1) -> dict:
    """``config_current.json``'s cluster (a prefill and a decode server per model, the same names and
    aliases) with the tiny models in place of the packaged ones: qwen3moe as "qwen", gpt-oss as
    "gpt-oss", ``parallel`` slots per server. Their answers are random text; the servers are real."""
    data = json.loads((Path(__file__).resolve().parents[1] / "config_current.json").read_text())
    for key, arch in (("qwen", "qwen3moe"), ("gpt-oss", "gpt-oss")):
        data["models"][key].update(model=str(tiny_gguf(arch)), n_ctx=n_ctx, parallel=parallel, n_threads=n_threads)
    return data


# -- real chat templates, as data ---------------------------------------------------------------

def llama_cpp_template(name: str) -> str:
    """A chat template from ``models/templates/`` of the llama.cpp that the installed llama-cpp-python vendors
    (``openai-gpt-oss-120b.jinja``, ``Qwen3-Coder.jinja``, ...), read from that version's source distribution,
    which pip downloads once into the cache (as data, like a model file: nothing of it is in the repository).
    Raises ``LookupError`` when it cannot be had (no index reachable)."""
    from importlib.metadata import version

    target = cache_dir().parent / "llama-cpp-templates" / version("llama-cpp-python") / name
    if not target.is_file():
        _extract_templates(target.parent, version("llama-cpp-python"))
    if not target.is_file():
        raise LookupError(f"llama-cpp-python's source distribution has no models/templates/{name}")
    return target.read_text()


def _extract_templates(dest: Path, llama_version: str, tarball: Path | None = None) -> None:
    import subprocess
    import sys
    import tarfile
    import tempfile

    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        if tarball is None:
            # --no-build-isolation: pip reads the version with the installed scikit-build-core (the test
            # extra) instead of installing its build requirements into a fresh environment (minutes)
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                                   "--no-build-isolation", "--quiet", "-d", tmp, f"llama-cpp-python=={llama_version}"],
                                  capture_output=True, text=True, timeout=1800)
            found = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            if done.returncode or not found:
                raise LookupError(f"pip could not download llama-cpp-python {llama_version}'s source: "
                                  f"{(done.stderr or done.stdout).strip()[-300:]}")
            tarball = found[0]
        with tarfile.open(tarball) as tar:
            for member in tar.getmembers():
                if member.isfile() and "/vendor/llama.cpp/models/templates/" in member.name:
                    data = tar.extractfile(member).read()
                    out = dest / Path(member.name).name
                    part = out.with_suffix(f".{os.getpid()}.tmp")
                    part.write_bytes(data)
                    part.replace(out)
