"""The grader's web interface (Streamlit): grade notebooks, read each student's report, watch the cluster.

Start it with ``python -m disaggregated_inference.webui`` (``--local-cluster`` to start the
servers too); see ``launcher.py``. Importing this package imports neither Streamlit nor a model library.
"""
