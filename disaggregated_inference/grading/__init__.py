"""The notebook grader: four layers of validation over two models running in parallel.

1. ``notebook``   - the submission is a valid, non-empty notebook within limits;
2. ``evidence``   - what the code and its saved outputs demonstrably contain (no model);
3. ``analysis``   - a code-analysis model scores, a feedback model writes, both at once,
                    JSON-schema constrained;
4. ``validation`` - answers checked (schema, then ``quality``), retried once with another seed or
                    dropped; each criterion scored from its evidence (``scoring``), moved by the
                    model within a band; ``feedback`` grounded in the checks' findings.

Beside them, ``rerun`` re-runs the notebook top to bottom in the ``sandbox`` (bubblewrap, a Jupyter kernel
through nbclient) with the rubric's hidden tests; its evidence judges ``runs_clean``, ``executed`` and the
tests' points. ``grader.grade_notebook`` runs them for one file, ``batch.grade_batch`` for a folder (``jobs`` at once,
its requests paced to the cluster by ``pace``, stoppable), ``report`` writes what comes out. Importing
this package loads no model library.
"""
from .batch import BatchProgress, BatchResult, StderrProgress, find_notebooks, grade_batch
from .grader import deterministic_part, grade_notebook
from .options import GradingOptions
from .report import gradebook_csv, render_markdown, summarize, write_batch_reports, write_result
from .rubric import Criterion, EvidenceRules, Rubric, load_rubric, rubric_from_dict

__all__ = ["BatchProgress", "BatchResult", "Criterion", "EvidenceRules", "GradingOptions", "Rubric", "StderrProgress",
           "deterministic_part", "find_notebooks", "grade_batch", "grade_notebook", "gradebook_csv", "load_rubric",
           "render_markdown", "rubric_from_dict", "summarize", "write_batch_reports", "write_result"]
