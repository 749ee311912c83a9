"""A GGUF file's vocabulary for the backends that run its weights elsewhere (MLX, transformers).

llama.cpp reads the file with ``vocab_only`` (no tensors, no download), so these
backends produce exactly the token ids a llama.cpp prefill server produces for the
same prompt, with the GGUF's own chat template; and the text of the tokens they
sample, and whether one ends the generation (neutral_engine.py's token loop).
"""
from __future__ import annotations

from .base import Prompt, gguf_prompt_tokens


class GgufVocab:
    def __init__(self, path):
        import llama_cpp
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self._llama_cpp = llama_cpp
        self.llama = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self._formatter = None
        template = self.llama.metadata.get("tokenizer.chat_template")
        if template:
            eos, bos = self.llama.token_eos(), self.llama.token_bos()
            self._formatter = Jinja2ChatFormatter(
                template=template,
                eos_token=self.llama._model.token_get_text(eos) if eos != -1 else "",
                bos_token=self.llama._model.token_get_text(bos) if bos != -1 else "",
            )

    def tokenize(self, prompt: Prompt) -> tuple[list[int], tuple]:
        """Token ids of a prompt and the stop strings its chat template adds."""
        return gguf_prompt_tokens(prompt, self._formatter, self.llama.tokenize)

    def is_eog(self, token: int) -> bool:
        return bool(self._llama_cpp.llama_vocab_is_eog(self.llama._model.vocab, token))

    def eog_tokens(self) -> list[int]:
        """Every end-of-generation token id of the vocabulary (for engines that stop by id themselves)."""
        vocab = self.llama._model.vocab
        return [t for t in range(self.llama.n_vocab()) if self._llama_cpp.llama_vocab_is_eog(vocab, t)]

    def piece(self, token: int) -> bytes:
        return self.llama.detokenize([token], special=False)

    def close(self) -> None:
        self.llama.close()
