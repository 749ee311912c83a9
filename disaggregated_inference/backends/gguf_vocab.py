"""A GGUF file's vocabulary and chat format, read by llama.cpp: what every engine that runs a GGUF shares.

``chat_format_of`` picks the model's chat format (chat/) from its metadata, with
the template renderer llama-cpp-python provides; ``GgufVocab`` is the vocabulary
for the backends that run the file's weights elsewhere (MLX, transformers):
llama.cpp reads the file with ``vocab_only`` (no tensors, no download), so these
backends produce exactly the token ids a llama.cpp prefill server produces for
the same prompt, with the same chat format; and the text of the tokens they
sample, and which ones end the generation (neutral_engine.py's token loop).
"""
from __future__ import annotations

from .. import chat
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


def chat_format_of(setting: str, metadata: dict, bos_text: str, eos_text: str):
    """The chat format of a GGUF (None: no template and no format of its own) for the ``chat_format`` option."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    return chat.choose(setting, arch=metadata.get("general.architecture"),
                       template=metadata.get("tokenizer.chat_template"),
                       make_renderer=lambda source: Jinja2ChatFormatter(template=source, eos_token=eos_text,
                                                                        bos_token=bos_text))


def end_tokens(fmt, eog: set, single_token) -> frozenset:
    """The token ids that end a generation read by ``fmt``: the vocabulary's end-of-generation tokens
    (``eog``), with the format's own ends and without those it continues past (harmony's ``<|end|>``);
    ``single_token(text)`` is the id of a special token's text, or None."""
    ends = set(eog)
    ends |= {t for t in map(single_token, fmt.end_texts) if t is not None}
    ends -= {t for t in map(single_token, fmt.continue_texts) if t is not None}
    return frozenset(ends)


class GgufVocab:
    def __init__(self, path, chat_format: str = "auto"):
        import llama_cpp

        self._llama_cpp = llama_cpp
        self.llama = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        model = self.llama._model
        eos, bos = self.llama.token_eos(), self.llama.token_bos()
        self.chat = chat_format_of(chat_format, self.llama.metadata,
                                   model.token_get_text(bos) if bos != -1 else "",
                                   model.token_get_text(eos) if eos != -1 else "")
        self._eog = {t for t in range(self.llama.n_vocab()) if llama_cpp.llama_vocab_is_eog(model.vocab, t)}
        self._ends: dict = {}
        self.longest_token = longest_token_bytes(model.vocab, self.llama.n_vocab())

    def tokenize(self, prompt: Prompt, n_ctx: int | None = None) -> tuple[list[int], tuple]:
        """Token ids of a prompt and the stop strings its chat template adds; text that cannot fit ``n_ctx``
        is refused first (``gguf_prompt_tokens``)."""
        return self.prompt_tokens(prompt, n_ctx)[:2]

    def prompt_tokens(self, prompt: Prompt, n_ctx: int | None = None) -> tuple[list[int], tuple, str]:
        """Token ids of a prompt, its template's stop strings and the chat format that rendered it."""
        return gguf_prompt_tokens(prompt, self.chat, self.llama.tokenize, n_ctx, self.longest_token)

    def special_tokens(self, text: str) -> list[int]:
        """The ids of ``text`` with special tokens' text read as those tokens."""
        return self.llama.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def ends(self, fmt) -> frozenset:
        """The ids that end a generation read by chat format ``fmt``."""
        if fmt.name not in self._ends:
            def single(text):
                ids = self.special_tokens(text)
                return ids[0] if len(ids) == 1 else None
            self._ends[fmt.name] = end_tokens(fmt, self._eog, single)
        return self._ends[fmt.name]

    def eog_tokens(self) -> list[int]:
        """Every end-of-generation token id of the vocabulary (for engines that stop by id themselves)."""
        return sorted(self._eog)

    def piece(self, token: int, special: bool = False) -> bytes:
        return self.llama.detokenize([token], special=special)

    def close(self) -> None:
        self.llama.close()
