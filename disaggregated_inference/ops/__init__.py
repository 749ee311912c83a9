"""Running servers: the gunicorn command and environment (``launch``), the local cluster
(``cluster``) and the ``disagg`` command line (``cli``).
"""
