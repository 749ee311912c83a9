"""The prefill and decode servers: Flask apps under gunicorn, one thread owning the model,
typed request parsing at the edge, metrics and health.
"""
