"""llama.cpp with a model that writes what a test scripted: every part real but the choice of token.

A tiny model has random weights, so what it says cannot be asked of it. This engine is the
llama_cpp backend (real llama.cpp, real KV handoff, the real token loop and chat format) with one
stage added in front of its sampler chain: while the text generated so far (the special tokens'
text included, what the loop fed included) follows a script, every token but the script's next
one is put out of reach. The script is chosen by a key in the prompt (``SCRIPTS``); where the
generation leaves its script (the loop fed the model the answer's opening, say), the script picks
up again after the same channel header, and where it ends the model samples freely (under a grammar
where one is active). Importing the module registers the engine as ``scripted_llama_cpp``; servers
learn of it from ``DISAGG_PLUGINS=tests.scripted_engine``.
"""
from __future__ import annotations

import numpy as np

from disaggregated_inference.backends import register
from disaggregated_inference.backends.llama_cpp import LlamaCppBackend
from disaggregated_inference.backends.llama_loop import TokenSampler

CHANNEL = "<|channel|>"
THINK = ("<|channel|>analysis<|message|>The user asks for a colour. Blue is calm; green is fresh. Pick blue."
         "<|end|><|start|>assistant<|channel|>final<|message|>Blue, the colour of the sea.<|return|>")
LONG = ("<|channel|>analysis<|message|>" + "Let me weigh every colour once more. " * 40
        + "<|end|><|start|>assistant<|channel|>final<|message|>Green.<|return|>")
TOOL = ("<|channel|>analysis<|message|>I need the weather first.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}<|call|>')
AFTER_TOOL = ("<|channel|>analysis<|message|>The tool says 21 degrees.<|end|><|start|>assistant<|channel|>final"
              "<|message|>It is 21 degrees in Paris.<|return|>")
# prose first, then the model writes the answer itself: only a grammar can make it JSON
FREE_JSON = "<|channel|>analysis<|message|>This is prose, not JSON: the answer must follow the schema.<|end|>" \
            "<|start|>assistant<|channel|>final<|message|>"
FEEDBACK = ('<|channel|>analysis<|message|>The notebook loads the data and plots it; say so kindly.<|end|>'
            '<|start|>assistant<|channel|>final<|message|>{"summary": "A clear, well organised analysis.", '
            '"strengths": ["The chart is labelled."], "improvements": ["Explain the outliers."]}<|return|>')
# a model that stops after its analysis: the loop must move it on to an answer
SILENT = "<|channel|>analysis<|message|>Nothing to add.<|return|>"
SCRIPTS = {"SCRIPT-THINK": THINK, "SCRIPT-LONG": LONG, "SCRIPT-TOOL": TOOL, "SCRIPT-AFTER-TOOL": AFTER_TOOL,
           "SCRIPT-FREE-JSON": FREE_JSON, "SCRIPT-FEEDBACK": FEEDBACK, "SCRIPT-SILENT": SILENT}


class ScriptedLlamaCpp(LlamaCppBackend):
    name = "scripted_llama_cpp"

    def _output(self, sampling, chat_name, stops, tokens):
        output = super()._output(sampling, chat_name, stops, tokens)
        prompt = self.model.detokenize(list(tokens), special=True).decode("utf-8", errors="replace")
        # the last key in the prompt: a conversation's latest turn says what comes next
        found = [(prompt.rfind(key), script) for key, script in SCRIPTS.items() if key in prompt]
        output.script = max(found)[1] if found else None
        return output

    def _sampler(self, sampling, output, schema=None):
        sampler = super()._sampler(sampling, output, schema)
        if getattr(output, "script", None) is None:
            return sampler
        steered = _internals_sampler()
        steered.add_custom(lambda candidates: self._steer(candidates, output))
        # the script's stage first, then the engine's own chain (grammar, then greedy or the distribution)
        import llama_cpp

        llama_cpp.llama_sampler_chain_add(steered.sampler, llama_cpp.llama_sampler_clone(sampler.chain.sampler))
        sampler.close()
        return TokenSampler(steered)  # the grammar first: the script's stage already holds one token in reach

    def _steer(self, candidates, output) -> None:
        target = self._next(output.script, output.text)
        if target is None:
            return
        data = np.ctypeslib.as_array(candidates.contents.data, shape=(candidates.contents.size,))
        logits = data["logit"]
        keep = data["id"] == target
        logits[~keep] = -np.inf

    def _next(self, script: str, text: str) -> int | None:
        """The script's next token after ``text``, or None where the model is free."""
        if script.startswith(text):
            rest = script[len(text):]
        else:
            cut = text.rfind(CHANNEL)
            anchor = text[cut:] if cut >= 0 else ""
            at = script.find(anchor) if anchor else -1
            if at < 0:
                return None
            rest = script[at + len(anchor):]
        ids = self._special_tokens(rest) if rest else []
        return ids[0] if ids else None


def _internals_sampler():
    from llama_cpp import _internals

    return _internals.LlamaSampler()


register("scripted_llama_cpp", ScriptedLlamaCpp)
