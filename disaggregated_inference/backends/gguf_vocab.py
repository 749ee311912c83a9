"""A GGUF file's vocabulary for the backends that run its weights elsewhere (MLX, transformers).

llama.cpp reads the file with ``vocab_only`` (no tensors, no download), so these
backends produce exactly the token ids a llama.cpp prefill server produces for the
same prompt, with the GGUF's own chat template; and the text of the tokens they
sample, and whether one ends the generation (neutral_engine.py's token loop).
"""
from __future__ import annotations

from .base import Prompt, gguf_prompt_tokens

# llama.cpp's vocabulary types whose tokens cover their own bytes of the text exactly (byte-level BPE;
# SentencePiece, whose "▁" is one space): a token count is at least bytes / the longest token there.
# WordPiece and Unigram normalize the text first (dropping or folding characters), so no such bound holds.
BOUNDED_VOCAB_TYPES = {1, 2}  # LLAMA_VOCAB_TYPE_SPM, LLAMA_VOCAB_TYPE_BPE


def longest_token_bytes(vocab, n_vocab: int) -> int:
    """The most bytes of text one token of ``vocab`` (a ``llama_vocab`` pointer) covers, special tokens
    included; 0 when the vocabulary's type gives no bound (``BOUNDED_VOCAB_TYPES``). Read once, at load."""
    import ctypes

    import llama_cpp

    if llama_cpp.llama_vocab_type(vocab) not in BOUNDED_VOCAB_TYPES:
        return 0
    size = 256
    buf = ctypes.create_string_buffer(size)
    longest = 0
    for token in range(n_vocab):
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, size, 0, True)
        longest = max(longest, abs(n))  # negative: the piece is longer than the buffer, -n bytes
    return longest


class GgufVocab:
    def __init__(self, path):
        import llama_cpp
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self._llama_cpp = llama_cpp
        self.llama = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self._formatter = None
        self.longest_token = longest_token_bytes(self.llama._model.vocab, self.llama.n_vocab())
        template = self.llama.metadata.get("tokenizer.chat_template")
        if template:
            eos, bos = self.llama.token_eos(), self.llama.token_bos()
            self._formatter = Jinja2ChatFormatter(
                template=template,
                eos_token=self.llama._model.token_get_text(eos) if eos != -1 else "",
                bos_token=self.llama._model.token_get_text(bos) if bos != -1 else "",
            )

    def tokenize(self, prompt: Prompt, n_ctx: int | None = None) -> tuple[list[int], tuple]:
        """Token ids of a prompt and the stop strings its chat template adds; text that cannot fit ``n_ctx``
        is refused first (``gguf_prompt_tokens``)."""
        return gguf_prompt_tokens(prompt, self._formatter, self.llama.tokenize, n_ctx, self.longest_token)

    def is_eog(self, token: int) -> bool:
        return bool(self._llama_cpp.llama_vocab_is_eog(self.llama._model.vocab, token))

    def piece(self, token: int) -> bytes:
        return self.llama.detokenize([token], special=False)

    def close(self) -> None:
        self.llama.close()
