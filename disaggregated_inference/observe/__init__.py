"""Watching a running cluster: what the dashboards show, computed once, drawn by each.

- ``scrape``: read one server's ``/health`` and ``/metrics`` (Prometheus text) into a ``Reading``;
- ``sampler``: a thread that reads every server of a config every few seconds and keeps the last minutes;
- ``figures``: the figures the panels show (percentiles, rates, method mix, prefix-cache share, link
  throughput against the capacity ``disagg doctor`` measured), from a client's request history and from
  the sampler's readings; plain functions, no drawing;
- ``top``: ``disagg top``, the same figures as text for a terminal.

The web dashboard (``webui/dashboard.py``) draws these figures with Altair; ``deploy/grafana/disagg.json``
asks Prometheus the same questions of the same metrics. Nothing here imports Streamlit.
"""
