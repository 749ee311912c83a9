"""A client for the grader: to a running cluster named by a config, or to an embedded local one."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

from .. import config as cluster_config
from ..errors import GradingError


def start_local_cluster(config=None, timeout: float = 600.0, progress=None):
    """Start every server of ``config`` on this machine, on free ports; wait until all are healthy.

    Returns the ``LocalCluster``; its ``config`` (a dict) says where the servers listen.
    """
    from ..ops.cluster import LocalCluster

    cluster = LocalCluster(cluster_config.coerce(config if config is not None else cluster_config.load()),
                           free_ports=True).start()
    try:
        cluster.wait_healthy(timeout=timeout, progress=progress)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def deterministic(cfg):
    """``cfg`` with every llama.cpp server's steps batch-invariant (``deterministic``), whatever its model
    entry or the server's own override says: a grade must not depend on what else the cluster was doing
    (docs/ARCHITECTURE.md, Determinism). Other engines' servers are left as they are."""
    def invariant(entry):
        if entry.settings.get("backend") != "llama_cpp" or entry.settings.get("deterministic") is not False:
            return entry  # unset: the engine's default, on
        return replace(entry, settings={**entry.settings, "deterministic": True})

    return replace(cfg, prefill_servers=[invariant(e) for e in cfg.prefill_servers],
                   decode_servers=[invariant(e) for e in cfg.decode_servers])


def require_servers(client, models=()) -> None:
    """Fail early, with a useful message, when no decode server of a needed model answers.

    (A model without a prefill server still works: its decode server generates alone.)
    """
    states = client.check_health()
    config = getattr(client, "config", None)
    keys = {config.resolve_model(m) if config else m for m in models} or {s["model"] for s in states}
    missing = [k for k in sorted(keys)
               if not any(s["role"] == "decode" and s["model"] == k and s["loaded"] for s in states)]
    if missing:
        where = ", ".join(f"{s['name']} ({s['url']}): {s['last_error'] or 'not loaded'}"
                          for s in states if s["model"] in missing) or "none configured"
        raise GradingError(f"no decode server answers for model {', '.join(missing)} [{where}]; start the "
                           "cluster (`disagg up`) or grade with --local-cluster")


DEFAULT_JOBS = 2


def decode_slots(client, default: int = DEFAULT_JOBS) -> int:
    """How many requests the cluster's decode servers can generate at once: the sum of their ``/health``
    ``slots.total`` (as last checked), or ``default`` when no server reports it."""
    total = 0
    for server in list(getattr(client, "servers", {}).values()):
        if server.entry.role != "decode" or not server.up:
            continue
        slots = (server.health.get("slots") or {}).get("total") if isinstance(server.health, dict) else None
        if isinstance(slots, int) and not isinstance(slots, bool) and slots > 0:
            total += slots
    return total or default


@contextmanager
def open_client(config=None, *, local_cluster: bool = False, timeout: float = 600.0, progress=None,
                models=("qwen", "gpt-oss")):
    """``with open_client(...) as client:`` - and the embedded cluster, if asked for, is stopped after."""
    from ..client import DisaggregatedClient

    cfg = cluster_config.coerce(config if config is not None else cluster_config.load())
    cluster = start_local_cluster(deterministic(cfg), timeout, progress) if local_cluster else None
    try:
        if cluster is not None:
            cfg = cluster_config.from_dict(cluster.config, f"{cfg.source} (embedded local cluster)")
        client = DisaggregatedClient(cfg)
        try:
            if models:
                require_servers(client, models)
            yield client
        finally:
            client.close()
    finally:
        if cluster is not None:
            cluster.stop()
