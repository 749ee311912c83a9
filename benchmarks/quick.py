"""What every benchmark's ``--quick`` shares.

``--quick`` runs a benchmark's own measuring code end to end in seconds: tiny sizes, few rounds, as
few servers as the benchmark needs, and, where the model's answers do not matter to what is
measured, a generated tiny llama-architecture GGUF (tests/tiny_models.py: random weights, SmolLM2's
tokenizer and chat template) instead of the packaged models. Its figures say that the benchmark
works and that its output is consistent (tests/test_benchmarks.py checks that); they are no
measurement to quote. Its OpenMP threads (llama.cpp's, in this process and in the servers it
starts) sleep at barriers (``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it): spinning
threads on a machine shared with other work (CI, a busy laptop) stretch seconds into minutes.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELP = ("seconds, not minutes: tiny sizes, few rounds, a generated tiny model where the answers do not "
        "matter; proves the benchmark runs and its JSON holds together, measures nothing to quote")


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help=HELP)


def apply(parser: argparse.ArgumentParser, args: argparse.Namespace, **values) -> argparse.Namespace:
    """With ``--quick``, each option named in ``values`` that the command line left at its default
    takes the quick value, and OpenMP threads will sleep at barriers. Call it before llama.cpp loads."""
    if args.quick:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read by libgomp when llama.cpp loads
        for key, value in values.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    return args


def tiny_model(head_dim: int | None = None) -> str:
    """Path of the tiny llama GGUF (written on first use, cached; tests/tiny_models.py); with ``head_dim``,
    one of its heads that wide (as many fewer heads: the same width)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from dataclasses import replace

    from tests.tiny_models import LLAMA, tiny_gguf

    if head_dim is None or head_dim == LLAMA.head_dim:
        return str(tiny_gguf("llama"))
    heads = LLAMA.n_embd // head_dim
    return str(tiny_gguf(replace(LLAMA, n_head=heads, n_head_kv=max(1, heads // 2), head_dim=head_dim)))


def on_tiny_model(data: dict, keep=("qwen",)) -> dict:
    """A cluster config dict with the models in ``keep`` on the tiny model and every other model,
    with its servers, left out."""
    path = tiny_model()
    data["models"] = {name: dict(entry, model=path, backend="llama_cpp")
                      for name, entry in data["models"].items() if name in keep}
    for role in ("prefill_servers", "decode_servers"):
        data[role] = [s for s in data[role] if s["model"] in keep]
    return data


def grader_requests(paths=None) -> list:
    """[(notebook path, ModelRequest)]: the requests the grader plans (``plan_requests``) for each notebook of
    ``paths`` (default: the calibration notebooks, then the other examples) that loads, with the embedded config's
    grading options."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import json

    from disaggregated_inference import config as cluster_config
    from disaggregated_inference.grading import GradingOptions, load_rubric
    from disaggregated_inference.grading.analysis import plan_requests
    from disaggregated_inference.grading.classgen import CALIBRATION
    from disaggregated_inference.grading.evidence import check_rubric, collect_evidence
    from disaggregated_inference.grading.notebook import load_submission

    options = GradingOptions.for_cluster(cluster_config.coerce(json.loads((ROOT / "config_current.json").read_text())))
    rubric = load_rubric(ROOT / "examples" / "rubric.yaml")
    out = []
    if paths is None:
        paths = sorted(CALIBRATION.glob("*.ipynb")) + sorted((ROOT / "examples" / "notebooks").glob("*.ipynb"))
    for path in paths:
        sub = load_submission(path)
        if not sub.ok:
            continue
        evidence = collect_evidence(sub.notebook)
        planned, _ = plan_requests(rubric, sub.notebook, evidence, check_rubric(rubric, evidence), options)
        out += [(path, r) for r in planned]
    return out


def say(message: str) -> None:
    """Progress, on stderr (stdout carries the JSON)."""
    print(message, file=sys.stderr, flush=True)
