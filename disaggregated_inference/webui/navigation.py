"""The web interface's entry script (what ``streamlit run`` runs): its two pages, by name.

Each page is a script that also runs alone (tests run them through Streamlit's AppTest). Icons are
Material Symbols, which Streamlit ships: they render without an emoji font.
"""
from pathlib import Path

import streamlit as st

HERE = Path(__file__).parent

st.navigation([
    st.Page(HERE / "app.py", title="Grade notebooks", icon=":material/grading:", url_path="grade", default=True),
    st.Page(HERE / "dashboard.py", title="Cluster dashboard", icon=":material/monitoring:", url_path="dashboard"),
]).run()
