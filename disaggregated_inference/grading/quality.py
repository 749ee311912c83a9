"""Answer quality checks, beyond schema validity: is a model's text about this notebook and worth showing?

A parsed answer fails when a reason repeats across criteria or copies the
prompt, a feedback item is a single word or shares nothing with the notebook
(its code, outputs or markdown), or the text degenerates into repetition.
``validation.obtain_answers`` retries a failing answer once with another seed,
then drops it: it never becomes a grade or feedback shown to a student.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from difflib import SequenceMatcher

MIN_WORDS = 3              # a reason or feedback item is a phrase, not a word
SAME_REASON = 0.9          # similarity above which two criteria's reasons are "the same"
COPIED_SHARE = 0.7         # share of a text found verbatim in the prompt's instructions
_WORD = re.compile(r"[a-z0-9_]+")
_CELL_REF = re.compile(r"\bcells?\s+(\d+)", re.I)
# Words that say nothing about a particular notebook.
GENERIC = set("""
a an and are as at be been but by can could do does for from good great has have how i if in into is it its
just make more most nice not of on or our should so some that the their them then there these this those to
too use used uses using very was well were what when which will with would you your yours also add adding
analysis code data notebook work student clear clean overall job better improve improvement consider try
""".split())


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def normalized(text: str) -> str:
    return " ".join(words(text))


@dataclass
class NotebookText:
    """What an item may be about: the notebook's words (code, outputs, markdown) and its cell numbers."""
    vocabulary: set = field(default_factory=set)
    cells: int = 0

    @classmethod
    def of(cls, notebook) -> "NotebookText":
        vocab: set = set()
        for cell in notebook.cells:
            texts = [cell.source]
            for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
                texts.append(str(output.get("text", "")))
                texts.append(str((output.get("data") or {}).get("text/plain", "")))
                texts.append(str(output.get("evalue", "")))
            for text in texts:
                for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text):  # identifiers split at _ too
                    vocab.update(p for p in [w.lower(), *w.lower().split("_")] if len(p) >= 3)
        return cls(vocab - GENERIC, len(notebook.cells))

    def grounded(self, text: str) -> bool:
        if any(1 <= int(n) <= self.cells for n in _CELL_REF.findall(text)):
            return True
        return any(w in self.vocabulary for w in words(text) if w not in GENERIC and len(w) >= 3)


def degenerate(text: str) -> str | None:
    """Why the text is degenerate repetition, or None."""
    ws = words(text)
    if re.search(r"(.)\1{9,}", text):
        return "a character repeated 10 or more times"
    for i in range(len(ws) - 3):
        if ws[i] == ws[i + 1] == ws[i + 2] == ws[i + 3]:
            return f"the word {ws[i]!r} repeated"
    grams: dict = {}
    for i in range(len(ws) - 2):
        gram = tuple(ws[i:i + 3])
        grams[gram] = grams.get(gram, 0) + 1
        if grams[gram] >= 3:
            return f"the phrase {' '.join(gram)!r} repeated"
    if len(ws) >= 12 and len(set(ws)) / len(ws) < 0.35:
        return "mostly the same few words"
    return None


def copied(text: str, instructions: str) -> bool:
    """True when most of ``text`` appears verbatim in the prompt's instructions (rubric and directions)."""
    t, p = normalized(text), normalized(instructions)
    if len(t) < 20 or not p:
        return False
    match = SequenceMatcher(None, p, t, autojunk=False).find_longest_match(0, len(p), 0, len(t))
    return match.size >= COPIED_SHARE * len(t)


def text_problems(text: str, instructions: str) -> list[str]:
    problems = []
    if len(words(text)) < MIN_WORDS:
        problems.append("fewer than 3 words")
    why = degenerate(text)
    if why:
        problems.append(f"degenerate repetition ({why})")
    if copied(text, instructions):
        problems.append("copies the prompt")
    return problems


def item_problems(item: str, instructions: str, notebook: NotebookText) -> list[str]:
    """What is wrong with one feedback item shown to a student (empty: it may be shown)."""
    problems = text_problems(item, instructions)
    if not notebook.grounded(item):
        problems.append("not about this notebook (no word of its code, outputs or markdown)")
    return problems


def _quote(text: str) -> str:
    return repr(text if len(text) <= 60 else text[:57] + "...")


def code_answer_problems(parsed: dict, instructions: str, notebook: NotebookText) -> list[str]:
    """Quality problems of a parsed code-analysis answer ({"scores": {id: {score, rationale}}, "issues"})."""
    problems = []
    reasons = [(cid, item["rationale"]) for cid, item in parsed["scores"].items()]
    for cid, reason in reasons:
        problems += [f"the reason for {cid} {_quote(reason)}: {p}" for p in text_problems(reason, instructions)]
    for i, (a, ra) in enumerate(reasons):
        for b, rb in reasons[i + 1:]:
            if SequenceMatcher(None, normalized(ra), normalized(rb), autojunk=False).ratio() >= SAME_REASON:
                problems.append(f"the same reason for {a} and {b}: {_quote(ra)}")
                break
    for issue in parsed.get("issues", []):
        problems += [f"the issue {_quote(issue)}: {p}" for p in item_problems(issue, instructions, notebook)]
    return problems


def feedback_answer_problems(parsed: dict, instructions: str, notebook: NotebookText) -> list[str]:
    """Quality problems of a parsed feedback answer ({"summary", "strengths", "improvements"})."""
    problems = [f"the summary: {p}" for p in text_problems(parsed["summary"], instructions)
                if p != "fewer than 3 words"]
    seen: set = set()
    for key in ("strengths", "improvements"):
        for item in parsed.get(key, []):
            problems += [f"{key[:-1]} {_quote(item)}: {p}" for p in item_problems(item, instructions, notebook)]
            if normalized(item) in seen:
                problems.append(f"{key[:-1]} {_quote(item)}: given twice")
            seen.add(normalized(item))
    return problems
