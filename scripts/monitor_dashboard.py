#!/usr/bin/env python3
"""The design documents' monitor_dashboard.py (the real-time dashboard): runs the web interface,
``python -m disaggregated_inference.webui``, with the same arguments; its Dashboard page shows
every server's health and the recent requests. See --help, and the table of script names in
docs/DEPLOYMENT.md.
"""
import importlib.util
import os
import sys
from pathlib import Path

python = sys.executable
venv = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "python"
if importlib.util.find_spec("disaggregated_inference") is None and venv.exists():
    python = str(venv)  # started with another Python: use the repository's environment
os.execv(python, [python, "-m", "disaggregated_inference.webui", *sys.argv[1:]])
