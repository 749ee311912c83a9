"""Server-Sent Events as the OpenAI API streams them: ``data: {json}`` lines, then ``data: [DONE]``."""
from __future__ import annotations

import json

DONE = "data: [DONE]\n\n"


def event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def ndjson_line(obj: dict) -> str:
    """One line of an Ollama stream."""
    return json.dumps(obj) + "\n"
