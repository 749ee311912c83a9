"""Layer 3: prompts, schemas, trimming, and both models asked at once (a FAKE client stands in for them)."""
from pathlib import Path

import nbformat

from disaggregated_inference.grading.analysis import (CODE, FEEDBACK, code_schema, feedback_schema, plan_requests,
                                                       render_notebook, run_requests)
from disaggregated_inference.grading.evidence import check_rubric, collect_evidence
from .fakes import FakeGradingClient
from disaggregated_inference.grading.notebook import load_submission
from disaggregated_inference.grading.options import GradingOptions
from disaggregated_inference.grading.rubric import load_rubric

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def long_notebook(cells=40, lines=30):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Intro\nThe setup.")]
    for i in range(cells):
        source = "\n".join(f"total_{i}_{j} = df['revenue'].sum() * {j}" for j in range(lines))
        nb.cells.append(nbformat.v4.new_code_cell(source, execution_count=i + 1, outputs=[
            nbformat.v4.new_output("stream", name="stdout", text="x" * 2000)]))
    nb.cells.append(nbformat.v4.new_markdown_cell("## Conclusions\nSouth leads."))
    return nb


def test_short_notebook_is_shown_whole():
    nb = load_submission(EXAMPLES / "notebooks" / "good_sales_analysis.ipynb").notebook
    rendered = render_notebook(nb, 10_000)
    assert not rendered.trimmed and rendered.omitted == []
    assert "### cell 2 (code, run 1)" in rendered.text
    assert "[image/png output]" in rendered.text and "iVBOR" not in rendered.text  # no base64 in prompts
    assert "South    825.0" in rendered.text


def test_long_notebook_is_trimmed_to_budget_with_a_note():
    nb = long_notebook()
    rendered = render_notebook(nb, 6000)
    assert len(rendered.text) <= 6000
    assert rendered.original_chars > 6000 and rendered.trimmed
    assert rendered.omitted[0] == "cell outputs shortened to 80 characters each (from 300)"
    left_out = [note for note in rendered.omitted if "left out (" in note and "context" in note]
    assert len(left_out) == 1
    assert f"[... {left_out[0]} ...]" in rendered.text
    # the beginning and the end survive: setup and conclusions
    assert "### cell 1 (markdown)" in rendered.text and "## Conclusions" in rendered.text


def test_one_huge_cell_is_shortened():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1\n" * 3000, execution_count=1)]
    rendered = render_notebook(nb, 4000)
    assert len(rendered.text) <= 4000
    assert rendered.omitted[-1].startswith("cell 1 shortened (")


def test_schemas():
    rubric = load_rubric(EXAMPLES / "rubric.yaml")
    schema = code_schema(rubric)
    scores = schema["properties"]["scores"]
    assert scores["required"] == rubric.ids and scores["additionalProperties"] is False
    assert scores["properties"]["data_loading"]["properties"]["score"]["enum"] == list(range(0, 9))
    assert set(feedback_schema()["required"]) == {"summary", "strengths", "improvements"}


def test_plan_requests_and_run_them_together():
    rubric = load_rubric(EXAMPLES / "rubric.yaml")
    nb = load_submission(EXAMPLES / "notebooks" / "errors_sales_analysis.ipynb").notebook
    ev = collect_evidence(nb)
    options = GradingOptions(seed=7)
    requests, rendered = plan_requests(rubric, nb, ev, check_rubric(rubric, ev), options)
    assert [r.role for r in requests] == [CODE, FEEDBACK]
    code, feedback = (r.kwargs for r in requests)
    assert (code["model"], feedback["model"]) == ("qwen", "gpt-oss")
    for kwargs in (code, feedback):
        assert kwargs["temperature"] == 0.0 and kwargs["seed"] == 7 and kwargs["json_schema"]
        assert "cell 4: raised NameError" in kwargs["prompt"]       # layer 2 facts reach the models
        assert "print(total_revenue)" in kwargs["prompt"]            # and so does the code
        assert "visualisation (0 to 10 points)" in kwargs["prompt"]  # and the rubric
    assert code["json_schema"] == code_schema(rubric)
    fake = FakeGradingClient(feedback=[RuntimeError("decode server gone")])
    answers, combined = run_requests(fake, requests)
    assert fake.rounds == [[CODE, FEEDBACK]]  # both models in one generate_many round
    assert combined["failed"] == 1
    assert answers[0].text and answers[0].metrics["method"] == "kv_handoff"
    assert answers[1].error == "RuntimeError: decode server gone" and answers[1].text is None


def test_budget_follows_the_models_context():
    small, large = GradingOptions(context_tokens=4096), GradingOptions(context_tokens=32768)
    assert 1000 < small.notebook_char_budget < large.notebook_char_budget
    # prompt + answer stay inside the context for the example notebooks
    rubric = load_rubric(EXAMPLES / "rubric.yaml")
    nb = long_notebook()
    ev = collect_evidence(nb)
    requests, _ = plan_requests(rubric, nb, ev, check_rubric(rubric, ev), small)
    for r in requests:
        assert len(r.kwargs["prompt"]) / small.chars_per_token + r.kwargs["max_tokens"] < small.context_tokens


def test_importing_the_grader_loads_no_model_or_ui_library():
    import subprocess
    import sys

    code = ("import sys, disaggregated_inference.grading, disaggregated_inference.grading.cli, "
            "disaggregated_inference.webui; "
            "print([m for m in ('llama_cpp', 'streamlit', 'torch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_feedback_models_reasoning_is_the_teachers_never_the_students(tmp_path):
    """The feedback request asks for low effort by default; a reasoning model's chain of thought comes back in the
    answer's metrics, stays in the result's record of that answer (the teacher's), and reaches neither the
    student's feedback nor the student-facing report."""
    from .fakes import FAKE_REASONING
    from disaggregated_inference.grading.grader import grade_notebook
    from disaggregated_inference.grading.report import render_markdown

    rubric = load_rubric(EXAMPLES / "rubric.yaml")
    fake = FakeGradingClient()
    result = grade_notebook(EXAMPLES / "notebooks" / "good_sales_analysis.ipynb", rubric, fake)
    (feedback_call,) = [c for c in fake.calls if c["json_schema"] == feedback_schema()]
    assert feedback_call["reasoning_effort"] == "low"
    (code_call,) = [c for c in fake.calls if c is not feedback_call]
    assert "reasoning_effort" not in code_call
    answers = {a["role"]: a for a in result["layers"]["analysis"]["answers"]}
    assert answers[FEEDBACK]["metrics"]["reasoning"] == FAKE_REASONING  # the record keeps it
    assert result["feedback"]["summary"] and FAKE_REASONING not in str(result["feedback"])
    assert "PRIVATE-CHAIN-OF-THOUGHT" not in render_markdown(result)
    none = GradingOptions(feedback_reasoning_effort=None)
    requests, _ = plan_requests(rubric, load_submission(EXAMPLES / "notebooks" / "good_sales_analysis.ipynb").notebook,
                                collect_evidence(nbformat.v4.new_notebook()), {}, none)
    assert all("reasoning_effort" not in r.kwargs for r in requests)
