"""llama.cpp's token loop: from a prompt's last token to the answer, one sampled token at a time.

Sampling is per sequence (a ``llama_sampler`` chain: grammar, top-k, top-p,
temperature, seeded distribution, or greedy; ``TokenSampler``).

**Chat formats.** Prompts are rendered and answers read by the model's chat
format (chat/): the token loop (``_continue``) feeds each sampled token's text
to the request's ``chat.Output`` and yields what it reads (answer, reasoning,
tool calls); the format decides which tokens end the generation, and when the
loop feeds the model text itself (a reasoning budget spent) or starts the
grammar of a schema that constrains the answer only.

**Speculation.** With a proposer (the model's ``speculation`` setting, or a request's), a generating
sequence's step may verify guesses after its token, with logits on every row; ``_continue`` keeps the
guesses the sampler would have chosen and removes the KV cells of the rest, so a slot holds exactly
the answer. ``speculate.py`` says why it is exact and how it decides which drafts pay.
"""
from __future__ import annotations

import codecs
import json
import logging
import math
import os
import time

from ..metrics import Method, ServerFigures
from .. import chat
from ..errors import BadRequest
from .base import Eval, Event, Sampling, rate
from .gguf_vocab import end_tokens
from .speculate import Lookahead, proposer

log = logging.getLogger(__name__)
STEP_COST_RETRY_SECONDS = 10.0  # a step cost measurement that found the cores busy is tried again after this


def grammar_allows(grammar, token: int) -> bool:
    """Whether the grammar sampler ``grammar``, in its present state, lets ``token`` through (asked about that
    token alone; its state does not change)."""
    import ctypes

    import llama_cpp

    cell = llama_cpp.llama_token_data(token, 1.0, 0.0)
    one = llama_cpp.llama_token_data_array(ctypes.pointer(cell), 1, -1, False)
    llama_cpp.llama_sampler_apply(grammar, ctypes.byref(one))
    return one.data[0].logit != float("-inf")


class TokenSampler:
    """One request's sampler: a llama.cpp sampler chain, and under a grammar the same chain without the grammar
    (``unconstrained``; the grammar is ``chain``'s sampler ``grammar_at``).

    Under a grammar it samples as llama.cpp's own server does (``common_sampler_sample``): the unconstrained
    choice first, the grammar asked about that one token, and the grammar over the whole vocabulary only when
    it refuses. Matching every token of the vocabulary against the grammar took most of a token's time (in
    process, one sequence, 2 threads, a JSON schema: Gemma 3's 262,144 tokens 137-147 ms a token against 26-27
    without the schema; SmolLM2's 49,152, 35 against 15).

    - Greedy: a grammar only takes tokens out, so the token is the one the grammar-first chain picks, bit for
      bit (the first of the highest logits either way).
    - At a temperature: a draw the grammar allows is kept, else the grammar chain draws again. Where top-k and
      top-p cut nothing, that is the grammar-first chain's distribution exactly (p(v) + P(refused) p(v) /
      P(allowed) = p(v) / P(allowed)); the draws are another stream of the seed, the same again for the same
      seed. The two chains' generators are seeded alike and each advances only when it draws.

    Greedy without a grammar (``greedy``: the row's logits, and the end-of-generation tokens ``ignore_eos`` bars)
    reads the argmax off the row's logits: the chain (the bias, then greedy) copies the whole vocabulary into
    candidates first, 180 us a row for SmolLM2's 49,152 on the 2-vCPU Intel VM against 3 for the argmax
    (docs/ARCHITECTURE.md, "Where a decode token's CPU time goes"). It is the chain's token bit for bit: the first
    of the highest logits, a barred token never; a NaN row goes to the chain."""

    def __init__(self, chain, unconstrained=None, grammar_at: int = 0, greedy=None):
        import llama_cpp

        self.chain, self.unconstrained = chain, unconstrained
        self._grammar = llama_cpp.llama_sampler_chain_get(chain.sampler, grammar_at) if unconstrained else None
        self.refused = 0  # unconstrained choices the grammar refused (each sampled again under it)
        self._greedy = greedy  # (row -> logits, barred token ids), or None

    def sample(self, ctx, row: int) -> int:
        """The token sampled from batch row ``row``'s logits; the chain (the grammar's state) has accepted it."""
        import llama_cpp

        if self._greedy is not None:
            logits_of, barred = self._greedy
            logits = logits_of(row)
            token = int(logits.argmax())
            if token in barred:  # rare: the bias would have put it out of reach
                logits = logits.copy()
                logits[list(barred)] = -math.inf
                token = int(logits.argmax())
            if not math.isnan(logits[token]):  # argmax takes the first NaN; the chain never picks one
                return token
        if self._grammar is None:
            return llama_cpp.llama_sampler_sample(self.chain.sampler, ctx, row)
        token = llama_cpp.llama_sampler_sample(self.unconstrained.sampler, ctx, row)
        if grammar_allows(self._grammar, token):
            llama_cpp.llama_sampler_accept(self.chain.sampler, token)
            return token
        self.refused += 1
        return llama_cpp.llama_sampler_sample(self.chain.sampler, ctx, row)

    def close(self) -> None:
        self.chain.close()
        if self.unconstrained is not None:
            self.unconstrained.close()


class TokenLoop:
    """The token loop of ``LlamaCppBackend`` (a part of that class: it reads the context, the model, the
    settings and the chat format that ``LlamaCppBackend.load`` sets, and steps through its slots)."""

    # -- the answer's reading and sampling --------------------------------------------------------

    def _output(self, sampling: Sampling, chat_name: str | None, stops, tokens) -> chat.Output:
        """How this request's answer is read: by the chat format its prompt was rendered with (``chat_name``,
        from the prefill side; None: this model's own), with the request's tools, schema, stop strings and
        reasoning budget. A schema that cannot become a grammar is refused here, before anything runs."""
        output = chat.Output(chat.for_output(chat_name, self.chat),
                             budget=min(sampling.max_new_tokens, self.settings.n_ctx - len(tokens)),
                             tools=sampling.tools, json_schema=sampling.json_schema,
                             stop=tuple(sampling.stop) + tuple(s for s in stops if s not in sampling.stop),
                             reasoning_budget=sampling.reasoning_budget)
        for schema in (output.start_schema, output.answer_schema):
            if schema is not None:
                self._grammar(schema)
        return output

    def _grammar(self, schema: dict):
        from llama_cpp.llama_grammar import LlamaGrammar

        try:
            return LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
        except Exception as exc:
            raise BadRequest(f"json_schema cannot be turned into a grammar: {exc}", field="json_schema") from None

    def _sampler(self, sampling: Sampling, output: chat.Output, schema: dict | None = None) -> "TokenSampler":
        """The sampler of one request: ``schema``'s grammar first (None: no grammar; the loop makes a new one
        when a schema that constrains only the answer comes due), then greedy, or top-k/top-p/temperature/seed.
        Under a grammar it also gets the chain without it (``TokenSampler``)."""
        import llama_cpp
        from llama_cpp import _internals

        grammar_at = 0  # where the grammar goes in the chain (after the end-of-generation bias, if any)

        def chain(grammar: bool):
            nonlocal grammar_at
            sampler = _internals.LlamaSampler()
            if sampling.ignore_eos:  # every end-of-generation token out of reach, before anything else samples
                sampler.add_logit_bias(self.model.n_vocab(), {t: float("-inf") for t in self._end_ids(output.format)})
            if grammar:
                grammar_at = llama_cpp.llama_sampler_chain_n(sampler.sampler)
                sampler.add_grammar(self.model, self._grammar(schema))
            if sampling.temperature <= 0:
                sampler.add_greedy()
            else:
                if sampling.top_k > 0:
                    sampler.add_top_k(sampling.top_k)
                sampler.add_top_p(sampling.top_p, 1)
                sampler.add_temp(sampling.temperature)
                seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(4), "little")
                sampler.add_dist(seed & 0xFFFFFFFF)
            return sampler

        with_grammar = chain(schema is not None)
        if schema is None:
            barred = self._end_ids(output.format) if sampling.ignore_eos else frozenset()
            return TokenSampler(with_grammar, greedy=(self._row_logits, barred) if sampling.temperature <= 0 else None)
        return TokenSampler(with_grammar, unconstrained=chain(False), grammar_at=grammar_at)

    def _eog_tokens(self) -> list[int]:
        """The vocabulary's end-of-generation token ids (computed once)."""
        import llama_cpp

        if self._eog is None:
            vocab = self.model.vocab
            self._eog = [t for t in range(self.model.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]
        return self._eog

    def _end_ids(self, fmt) -> frozenset:
        """The token ids that end a generation read by chat format ``fmt`` (computed once per format)."""
        if fmt.name not in self._ends:
            def single(text):
                ids = self._special_tokens(text)
                return ids[0] if len(ids) == 1 else None
            self._ends[fmt.name] = end_tokens(fmt, set(self._eog_tokens()), single)
        return self._ends[fmt.name]

    def _token_text(self, token: int, special: bool) -> bytes:
        """The text of one sampled token (``special``: a special token's own text), from the vocabulary once: a
        detokenize is a buffer and two calls into llama.cpp, 10 us a token right after a step here."""
        key = (token, special)
        piece = self._token_texts.get(key)
        if piece is None:
            piece = self._token_texts[key] = self.model.detokenize([token], special=special)
        return piece

    def _special_tokens(self, text: str) -> list[int]:
        """The ids of ``text``, special tokens' text read as those tokens (what the loop feeds the model)."""
        return self.model.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    # -- the loop ---------------------------------------------------------------------------------

    def _proposer(self, sampling: Sampling):
        """The request's draft proposer (speculate.py), or None: the request's ``speculation`` if it names one,
        else the model's setting; with deterministic steps, one that guesses in a lone sequence's padding row
        even with ``off`` (free: the answer is the same, and a right guess gives two tokens a step). The step cost is measured the first time a proposer is needed (on the owner
        thread, between steps: a fraction of a second, once)."""
        kind = sampling.speculation or self.settings.speculation
        if kind != "off" and self._step_cost is None and time.monotonic() >= self._step_cost_retry_at:
            self._step_cost = self._measure_step_cost()
            self._step_cost_retry_at = time.monotonic() + STEP_COST_RETRY_SECONDS
            if self._step_cost is not None:
                log.info("speculation: a step costs %s", self._step_cost)
        if kind != "off" and self._step_cost is None:
            kind = "off"  # no step cost to weigh drafts with (other work held the cores): none this request
        return proposer(kind, self.settings.draft_max, self.settings.draft_min_match, free_row=self._free_row,
                        record=self._draft_record)

    def _continue(self, seq, tokens, sampler, output: chat.Output, sampling: Sampling, *, cancelled, started,
                  recomputed, extra, canary: dict | None = None, evaluated: Eval | None = None, drafts=None):
        """Evaluate the prompt's last token in ``seq`` (which holds the rest), then sample the answer.

        Each sampled token goes to ``output`` (``take``: the chat format's reading of it) and what it reads
        is yielded; a token that ends the generation by the format's rules ends it, unless the format would
        rather move the model on to its answer. Text the format has the model go on with (that opening, or
        after a spent reasoning budget) is evaluated with the next step, and a schema that constrains only
        the answer gets its grammar when ``schema_due`` says so.

        With ``canary`` (a handed-over state; ``{}`` when its bundle carried none), the next-token
        distribution is checked against the prefill side's first: ``CanaryMismatch`` before anything
        is sampled when it is beyond tolerance. ``evaluated``: that token's ``Eval``, already done
        (a streamed state's, while its canary was on its way), its row still valid. The caller closes the
        sampler it passed; one made here is closed here.

        The steps come from a ``speculate.Lookahead``: with a proposer (``drafts``) a step may verify
        guesses, and while the token sampled from a row is the guess after it the next row is sampled
        without a step; everything else (the format's end, stop strings, the budget, cancellation, text
        the format feeds) is decided per token as without. Fed text ends a draft: its guesses' cells go."""
        import llama_cpp

        ends = self._end_ids(output.format)
        special = output.format.special_text
        budget = min(sampling.max_new_tokens, self.settings.n_ctx - len(tokens))
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        generated, fed, finish = 0, 0, "length"
        t_gen = time.perf_counter()
        look = Lookahead(seq, tokens, drafts, self._drop_cells)
        ev = look.first(evaluated)
        if evaluated is None:
            yield ev
        recomputed += 1
        if canary is not None:
            extra = extra.with_(**self.canary.check(canary, self._row_logits(ev.row), self.engine,
                                                    exact=ev.alone and self._restores_exactly(len(tokens)),
                                                    threads=self._threads,
                                                    deterministic=self._steps).given())
        first_at = time.perf_counter()
        own = None  # a sampler this loop made (the answer's grammar)
        try:
            while True:
                token = sampler.sample(self.ctx.ctx, look.row)
                kept = look.sampled(token)  # a guess the step evaluated: its KV is in place, the next row ready
                step = output.take(None if token in ends else decoder.decode(self._token_text(token, special)))
                for part in step.parts:
                    yield Event.of(part)
                if step.done:
                    finish = "stop"
                    break
                if step.sampled:
                    generated += 1
                    if generated + fed >= budget or cancelled():
                        finish = "cancelled" if cancelled() else "length"
                        break
                elif kept:  # the format replaces the token with text: its cell goes
                    look.unkeep()
                    kept = False
                evaluate = [token] if step.sampled and not kept else []
                if step.feed is not None:  # text the format has the model go on with (chat/output.py)
                    ids = self._special_tokens(step.feed)
                    if generated + fed + len(ids) >= budget:  # no room left for an answer after them
                        break
                    fed += len(ids)
                    evaluate += ids
                    for part in output.fed(step.feed, len(ids)):
                        yield Event.of(part)
                schema = output.schema_due()
                if schema is not None:  # the answer opened: its grammar from the next token on
                    if own is not None:
                        own.close()
                    sampler = own = self._sampler(sampling, output, schema)
                if not kept or step.feed is not None:  # else the next row is ready without a step
                    yield look.step(evaluate, budget - generated - fed, draft=step.feed is None)
        finally:
            if own is not None:
                own.close()
        for part in output.close(decoder.decode(b"", final=True)):
            yield Event.of(part)
        ended = time.perf_counter()
        decode_time = ended - t_gen
        metrics = {
            "prompt_tokens": len(tokens),
            "prompt_tokens_recomputed": recomputed,
            "completion_tokens": generated + fed,
            "decode_time": round(decode_time, 6),
            "decode_speed": rate(generated, decode_time),
            "first_token_time": round(first_at - t_gen, 6),
            "backend_time": round(ended - started, 6),
            "finish_reason": output.finish_reason(finish),
            **output.metrics().given(),
            **extra.given(),
        }
        if drafts is not None and drafts.speculation:  # not a padding row's guesses alone
            metrics.update(speculation=sampling.speculation or self.settings.speculation, **look.finish().given())
        if extra.method != Method.KV_HANDOFF:  # the prompt was computed here: say how long it took
            metrics["prefill_time"] = round(t_gen - started, 6)
            metrics["prefill_speed"] = rate(recomputed, t_gen - started)  # the tokens evaluated here
        yield Event(metrics=ServerFigures.of(**metrics))
