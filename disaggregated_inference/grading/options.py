"""How a grade is produced: which models, how long their answers may be, how much notebook fits."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from .notebook import Limits

DEFAULT_SEED = 20251109


@dataclass(frozen=True)
class GradingOptions:
    code_model: str = "qwen"          # code analysis and scores (the seeds' qwen3-coder:30b)
    feedback_model: str = "gpt-oss"   # feedback to the student (the seeds' gpt-oss:120b)
    temperature: float = 0.0
    retry_temperature: float = 0.4    # a retry samples (with seed + 1, so still reproducible) for another answer
    seed: int = DEFAULT_SEED
    code_max_tokens: int = 768
    feedback_max_tokens: int = 768
    # how hard the feedback model thinks before its JSON (gpt-oss reasons first; models without a reasoning
    # channel ignore it); its reasoning stays in the teacher's report, never in the student's feedback
    feedback_reasoning_effort: str | None = "low"
    # prompt-lookup speculation for the code model's answers (JSON keys, criterion ids and code quoted from the
    # prompt: 1.47x measured one at a time); the server drafts only where its step cost says a draft pays, and
    # with deterministic steps a greedy answer is the same with it or without (docs/benchmarks.md)
    code_speculation: str | None = "ngram"
    context_tokens: int = 4096        # the smaller context of the two models
    chars_per_token: float = 2.5      # a cautious estimate for code; keeps prompts inside the context
    output_chars: int = 300           # of each cell's text output shown to the models
    limits: Limits = field(default_factory=Limits)
    # re-run each notebook in the sandbox (sandbox.py) where one works here: the command line and the web
    # interface turn it on (--execute off turns it off); a library call runs no student code unless asked
    execute: bool = False

    @property
    def notebook_char_budget(self) -> int:
        """Characters of notebook that fit beside the instructions and the longest answer."""
        answer = max(self.code_max_tokens, self.feedback_max_tokens)
        instructions = 700  # tokens of rubric, evidence and instructions (rubrics of a few criteria)
        tokens = self.context_tokens - answer - instructions - 64
        return max(1000, int(tokens * self.chars_per_token))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def for_cluster(cls, config, **overrides) -> "GradingOptions":
        """Options whose context budget fits the configured models (their smallest ``n_ctx``)."""
        options = cls(**overrides)
        if "context_tokens" in overrides or config is None:
            return options
        keys = set()
        for name in (options.code_model, options.feedback_model):
            try:
                keys.add(config.resolve_model(name))
            except Exception:  # an unknown model is reported when it is asked for
                continue
        sizes = [config.models[k].get("n_ctx") for k in keys if config.models.get(k, {}).get("n_ctx")]
        return replace(options, context_tokens=min(sizes)) if sizes else options
