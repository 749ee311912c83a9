"""A generated class: notebooks made from the calibration set, each one varied, the same every time.

    python -m disaggregated_inference.grading.classgen OUT --count 30     # OUT/s01.ipynb ... OUT/s30.ipynb

Student ``i`` starts from one of the calibration notebooks (excellent, decent, weak, wrong in
turn) and gets, drawn from a generator seeded with ``seed`` and ``i``: a name of its own, its
variable renamed, its numbers in the text changed, a cell dropped, an extra exploration cell,
a cell that failed when it ran, a cell left unrun, or its conclusions reworded. So the grader
sees a class whose notebooks differ in their evidence and their text, as a real one does, and
a benchmark or test grading it twice grades the same class. Nothing here runs a notebook: the
outputs are the calibration set's, edited as text.
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import re
from pathlib import Path

CALIBRATION = Path(__file__).resolve().parents[2] / "examples" / "calibration"
BASES = ("excellent", "decent", "weak", "wrong")
NAMES = ("Ada Lovelace", "Alan Turing", "Barbara Liskov", "Claude Shannon", "Donald Knuth", "Edsger Dijkstra",
         "Frances Allen", "Grace Hopper", "Hedy Lamarr", "John Backus", "Karen Sparck Jones", "Katherine Johnson",
         "Leslie Lamport", "Margaret Hamilton", "Niklaus Wirth", "Radia Perlman", "Shafi Goldwasser",
         "Sophie Wilson", "Tim Berners-Lee", "Whitfield Diffie", "Adele Goldberg", "Dennis Ritchie",
         "Jean Sammet", "Ken Thompson", "Lynn Conway", "Mary Kenneth Keller", "Peter Naur", "Ivan Sutherland",
         "Evelyn Berezin", "Tony Hoare", "Kathleen Booth", "Robin Milner", "Joan Clarke", "John McCarthy",
         "Annie Easley", "Alonzo Church", "Ida Rhodes", "Butler Lampson", "Betty Holberton", "Fran Bilas")
VARIABLES = ("sales", "data", "orders", "frame")
EXTRA_CELLS = (
    ('df.describe()', "             units     revenue\ncount  12.000000   12.000000\nmean    8.750000  210.416667"),
    ('df["region"].value_counts()', "region\nNorth    3\nSouth    3\nEast     3\nWest     3\nName: count"),
    ('df.isna().sum()', "date       0\nregion     0\nproduct    0\nunits      0\nrevenue    0\ndtype: int64"),
)
FAILED_CELLS = (
    ('df.groupby("Region")["revenue"].sum()', "KeyError", "'Region'"),
    ('monthly = df.resample("M").sum()', "TypeError", "Only valid with DatetimeIndex, TimedeltaIndex or PeriodIndex"),
    ('print(total_sales)', "NameError", "name 'total_sales' is not defined"),
)
CLOSINGS = ("", "Next I would look at the products within each region.",
            "The data covers one quarter only, so these trends are tentative.",
            "I would collect more months of data before recommending changes.")
NUMBER = re.compile(r"(?<![\w.\-])(\d{2,4})(\.\d+)?(?![\w.\-])")  # not in dates or names


def _lines(text: str) -> list[str]:
    """Text as a notebook stores it: a list of lines, each but the last with its newline."""
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _text(source) -> str:
    return "".join(source) if isinstance(source, list) else str(source)


def _rename(code: str, name: str) -> str:
    return re.sub(r"\bdf\b", name, code)


def _scale_numbers(text: str, factor: float) -> str:
    def scaled(match: re.Match) -> str:
        return f"{round(int(match.group(1)) * factor)}{match.group(2) or ''}"
    return NUMBER.sub(scaled, text)


def _code_cell(source: str, outputs: list, count: int | None) -> dict:
    return {"cell_type": "code", "execution_count": count, "metadata": {}, "outputs": outputs,
            "source": _lines(source)}


def vary(notebook: dict, rng: random.Random, name: str) -> dict:
    """One student's version of a calibration notebook (a new dict; ``notebook`` is not changed)."""
    nb = copy.deepcopy(notebook)
    cells = nb["cells"]
    title = next((c for c in cells if c["cell_type"] == "markdown"), None)
    if title is not None:
        text = re.sub(r"Student: [^.\n]+", f"Student: {name}", _text(title["source"]))
        title["source"] = _lines(text if "Student:" in text else f"{text}\n\nStudent: {name}.")
    code = [c for c in cells if c["cell_type"] == "code"]
    if rng.random() < 0.35:  # another variable name for the data frame, in the code only
        variable = rng.choice(VARIABLES)
        for cell in code:
            cell["source"] = _lines(_rename(_text(cell["source"]), variable))
    if rng.random() < 0.5:  # other figures in the text the student wrote and the outputs printed
        factor = rng.choice((0.8, 0.9, 1.1, 1.25))
        for cell in cells:
            if cell["cell_type"] == "markdown" and cell is not title:
                cell["source"] = _lines(_scale_numbers(_text(cell["source"]), factor))
            for output in cell.get("outputs", []):
                if output.get("output_type") == "stream":
                    output["text"] = _lines(_scale_numbers(_text(output["text"]), factor))
    if len(code) > 2 and rng.random() < 0.25:  # a step left out (never the loading cell)
        cells.remove(rng.choice(code[1:]))
    if rng.random() < 0.3:  # an extra look at the data
        source, shown = rng.choice(EXTRA_CELLS)
        at = min(2, len(cells))
        cells.insert(at, _code_cell(source, [{"output_type": "execute_result", "execution_count": 90,
                                               "metadata": {}, "data": {"text/plain": _lines(shown)}}], 90))
    if rng.random() < 0.15:  # a cell that failed when it ran
        source, ename, evalue = rng.choice(FAILED_CELLS)
        cells.insert(len(cells) - 1, _code_cell(source, [{"output_type": "error", "ename": ename, "evalue": evalue,
                                                          "traceback": [f"{ename}: {evalue}"]}], 91))
    if code and rng.random() < 0.1:  # one cell never run
        cell = rng.choice([c for c in cells if c["cell_type"] == "code"])
        cell["execution_count"], cell["outputs"] = None, []
    closing = rng.choice(CLOSINGS)
    last = cells[-1] if cells and cells[-1]["cell_type"] == "markdown" else None
    if closing and last is not None and last is not title:
        last["source"] = _lines(_text(last["source"]).rstrip() + f"\n\n{closing}")
    for n, cell in enumerate(cells):  # unique ids, as nbformat 4.5 wants
        cell["id"] = f"cell-{n}"
    return nb


def generate_class(out_dir, count: int = 30, seed: int = 0, source=CALIBRATION) -> list[Path]:
    """Write ``count`` notebooks ``s01.ipynb``... into ``out_dir``; return their paths. The same
    ``count``, ``seed`` and calibration set give the same bytes."""
    source, out_dir = Path(source), Path(out_dir)
    bases = {name: json.loads((source / f"{name}.ipynb").read_text(encoding="utf-8")) for name in BASES}
    out_dir.mkdir(parents=True, exist_ok=True)
    width = max(2, len(str(count)))
    paths = []
    for i in range(count):
        rng = random.Random(f"{seed}:{i}")
        notebook = vary(bases[BASES[i % len(BASES)]], rng, NAMES[i % len(NAMES)])
        path = out_dir / f"s{i + 1:0{width}d}.ipynb"
        path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        paths.append(path)
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disaggregated_inference.grading.classgen",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder for the notebooks")
    parser.add_argument("--count", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = generate_class(args.out, args.count, args.seed)
    print(f"{len(paths)} notebooks in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
