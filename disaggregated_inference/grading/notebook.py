"""Layer 1, the submission: is the file a usable Jupyter notebook?

``load_submission(path)`` never raises for a bad file: it returns a
``Submission`` whose ``problems`` say what is wrong, so a batch goes on.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..kv.fingerprint import sha256_of

MAX_BYTES = 5 << 20   # larger files are usually embedded data or many images
MAX_CELLS = 500


@dataclass(frozen=True)
class Limits:
    max_bytes: int = MAX_BYTES
    max_cells: int = MAX_CELLS


@dataclass
class Submission:
    path: Path
    name: str                      # the student's submission id (file name without extension)
    sha256: str | None = None
    size_bytes: int | None = None
    notebook: object | None = None  # nbformat.NotebookNode (v4) when the file is usable
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.notebook is not None and not self.problems

    def summary(self) -> dict:
        cells = self.notebook.cells if self.notebook is not None else []
        return {
            "ok": self.ok,
            "problems": list(self.problems),
            "size_bytes": self.size_bytes,
            "cells": len(cells),
            "code_cells": sum(1 for c in cells if c.cell_type == "code"),
            "markdown_cells": sum(1 for c in cells if c.cell_type == "markdown"),
        }


def submission_name(path, root=None) -> str:
    """The id of a submission: its path under ``root`` without the suffix, '/' turned into '__'."""
    path = Path(path)
    try:
        rel = path.relative_to(root) if root else Path(path.name)
    except ValueError:
        rel = Path(path.name)
    return "__".join(rel.with_suffix("").parts)


def load_submission(path, limits: Limits | None = None, name: str | None = None) -> Submission:
    import nbformat

    limits = limits or Limits()
    path = Path(path)
    sub = Submission(path=path, name=name or submission_name(path))
    try:
        sub.size_bytes = path.stat().st_size
    except OSError as exc:
        sub.problems.append(f"cannot read the file: {exc.strerror or exc}")
        return sub
    if not path.is_file():
        sub.problems.append("not a regular file")
        return sub
    if sub.size_bytes > limits.max_bytes:
        sub.sha256 = sha256_of(path)
        sub.problems.append(f"file is {sub.size_bytes} bytes; the limit is {limits.max_bytes}")
        return sub
    raw = path.read_bytes()
    sub.sha256 = hashlib.sha256(raw).hexdigest()
    if not raw.strip():
        sub.problems.append("the file is empty")
        return sub
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        sub.problems.append("not a notebook: the file is not UTF-8 text")
        return sub
    except json.JSONDecodeError as exc:
        sub.problems.append(f"not a notebook: invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})")
        return sub
    except (RecursionError, MemoryError) as exc:  # crafted JSON: arrays nested thousands deep
        sub.problems.append(f"not a notebook: the JSON cannot be read ({type(exc).__name__}: nested too deeply)")
        return sub
    if not isinstance(data, dict) or "cells" not in data and "worksheets" not in data:
        sub.problems.append("not a notebook: the JSON has no 'cells'")
        return sub
    try:
        with warnings.catch_warnings():  # e.g. missing cell ids: repaired on read, not the student's fault
            warnings.simplefilter("ignore")
            nb = nbformat.reads(raw.decode("utf-8"), as_version=4)
            nbformat.validate(nb)
    except nbformat.ValidationError as exc:
        where = "/".join(str(p) for p in getattr(exc, "absolute_path", []) or [])
        sub.problems.append(f"not a valid nbformat v4 notebook: {str(exc.message)[:200]}"
                            + (f" (at {where})" if where else ""))
        return sub
    except Exception as exc:  # nbformat raises several types for unreadable or unknown versions
        sub.problems.append(f"not a readable nbformat notebook: {type(exc).__name__}: {str(exc)[:200]}")
        return sub
    sub.notebook = nb
    if len(nb.cells) > limits.max_cells:
        sub.problems.append(f"the notebook has {len(nb.cells)} cells; the limit is {limits.max_cells}")
    elif not any(c.cell_type == "code" and c.source.strip() for c in nb.cells):
        sub.problems.append("the notebook has no code")
    return sub
