"""Cluster configuration: which models exist, which servers serve them, timeouts.

One JSON file (``config_current.json``) drives the client, the local cluster,
the server launcher and the operations scripts. It is validated once, on load;
a bad file gets one ``ConfigError`` naming the file, the key and what was
expected. The design documents' shape (``prefill_servers``/``decode_servers`` lists
of ``{host, port, model, name}`` and nothing else) loads as it is: its model keys
are the production roles, served by Ollama.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from . import backends, routing
from .backends import options
from .errors import ConfigError
from .tuning import MIN_NON_TEMPORAL_BYTES, OPENMP_WAITS
from .watch import HEARTBEAT_SECONDS

DEFAULT_CONFIG_FILE = "config_current.json"

# What a model entry carries besides its engine's options (backends/options.py), and what a server
# entry carries besides the options it overrides for that machine ("model" names a model entry).
MODEL_ENTRY_KEYS = {"aliases": list}
SERVER_ENTRY_KEYS = {"name": str, "host": str, "port": int, "model": str, "data_url": str,
                     # the machine's draw and its hardware's cost (disagg bench: an energy estimate where the
                     # machine has no counter, and the cost per request); one machine's servers count it once
                     "power_watts": (int, float), "cost_per_hour": (int, float)}
CLIENT_DEFAULTS = {
    # the caller's deadlines: for a prefill (queueing included), and for a decode's whole answer (a
    # stream's: until its first piece); running out blames no server that was still working (watch.py)
    "prefill_timeout": 60.0,
    "decode_timeout": 180.0,
    # a server that sends nothing, not even its heartbeat (one a second while it works), for this long
    # is taken as hung: the request moves on and the server is marked down until it answers again
    "progress_timeout": 5.0,
    "connect_timeout": 3.0,
    "health_timeout": 2.0,
    "health_check_interval": 10.0,
    "failures_before_down": 2,
    "retries": 1,
    "history_size": 200,
    "api_token": None,
    # per request, the KV handoff or the decode server alone (routing.py): "auto" decides from measured
    # costs; "handoff" (the default: every request disaggregated, as before) or "decode_only" force a path
    "route": "handoff",
    # how the KV leaves the prefill server: "streamed" (the default: the overlapped handoff, the decode server
    # pulling while the prompt is evaluated, where the model allows it) or "whole" (after the prefill, as before)
    "handoff_mode": "streamed",
}
HANDOFF_MODES = ("streamed", "whole")

# The ``gateway`` section: where ``disagg gateway`` (the OpenAI/Ollama front door) listens.
GATEWAY_DEFAULTS = {
    "host": "127.0.0.1",
    "port": 8080,
    "api_token": None,  # a bearer token the gateway's callers must send; None: open
}


@dataclass(frozen=True)
class ServerOptions:
    """The ``server`` section of a config: limits every server of the cluster runs with.

    The one place these defaults are written; ``server.settings.ServerSettings`` extends it
    with what is particular to one server (its role, model and name).
    """

    lease_seconds: float = 30.0
    queue_timeout: float = 30.0
    kv_fetch_timeout: float = 60.0
    connect_timeout: float = 3.0
    slow_transfer_seconds: float = 1.0
    kv_buffer_idle_seconds: float = 300.0  # decode: how long a freed receive buffer is kept warm
    kv_socket_buffer_bytes: int = 4 << 20  # decode: the KV pull's socket receive buffer; 0 = the kernel's
    non_temporal_copy_bytes: int = 256 << 10  # copies this large bypass the CPU cache (tuning.py); 0 = glibc's
    max_kv_bytes: int = 64 << 30
    api_token: str | None = None
    threads: int = 32  # gunicorn request threads of each server: threads - 1 may wait for or hold a model slot
    # llama.cpp's CPU threads at a barrier: "spin" (OpenMP's default: spin briefly, then sleep), "sleep"
    # (OMP_WAIT_POLICY=PASSIVE), or "auto": spin while the servers on one machine share its cores
    # (share_cores), else sleep only when they have more compute threads than it has cores (tuning.py)
    openmp_wait: str = "auto"
    # the llama.cpp servers of the cluster on one machine compute with the threads that fit its cores:
    # all of theirs while alone, a share while others are busy (server/cores.py)
    share_cores: bool = True
    max_queue: int = 64  # requests waiting for a slot beyond which a server answers 503 at once
    # Trust and limits (docs/ARCHITECTURE.md, "Trust and limits")
    kv_sources: tuple = ()  # decode: hosts/URLs it may pull KV from besides the cluster's prefill servers
    kv_progress_timeout: float = 5.0  # decode: a KV pull with no byte arriving for this long is abandoned
    max_request_bytes: int = 8 << 20  # every server: larger request bodies get 413
    max_prompt_chars: int = 1 << 20  # prompt + system + messages' contents, in characters
    max_schema_bytes: int = 64 << 10  # json_schema, as compact JSON
    max_lease_bytes: int = 32 << 30  # prefill: bytes of KV held under leases at once; beyond, 503
    max_lease_seconds: float = 600.0  # prefill: the longest lease_seconds a request may ask for
    body_timeout: float = 10.0  # seconds a client has to send its request body (408 after)
    header_timeout: float = 10.0  # seconds a client has to send its request line and headers (408 after)
    # The handoff canary (kv/canary.py; docs/ARCHITECTURE.md, "The canary")
    canary_top_k: int = 8  # prefill: top-k log-probs of the next-token distribution in each bundle; 0 = off
    canary_tolerance: float = 0.5  # decode: max abs log-prob difference allowed, same engine on both sides
    canary_cross_tolerance: float = 1.0  # decode: the same for any other pair of engines
    canary_exact_tolerance: float = 1e-4  # decode: same engine, both evaluated alone, bit-exact restore
    canary_pairs: tuple = ()  # decode: {"prefill": "llama_cpp/cuda", "decode": "llama_cpp/cpu", "tolerance": 2.0}


SERVER_DEFAULTS = {f.name: f.default for f in fields(ServerOptions)}

# Ranges checked on load: key -> (lowest allowed, whether the lowest itself is allowed).
CLIENT_RANGES = {"prefill_timeout": (0, False), "decode_timeout": (0, False), "connect_timeout": (0, False),
                 "progress_timeout": (HEARTBEAT_SECONDS, False),
                 "health_timeout": (0, False), "health_check_interval": (0, True),
                 "failures_before_down": (1, True), "retries": (0, True), "history_size": (1, True)}
SERVER_RANGES = {"lease_seconds": (0, False), "queue_timeout": (0, False), "kv_fetch_timeout": (0, False),
                 "connect_timeout": (0, False), "slow_transfer_seconds": (0, True), "kv_buffer_idle_seconds": (0, True),
                 "kv_socket_buffer_bytes": (0, True), "max_kv_bytes": (1, True), "threads": (2, True),
                 "kv_progress_timeout": (0, False), "max_request_bytes": (1024, True), "max_prompt_chars": (1, True),
                 "max_schema_bytes": (2, True), "max_lease_bytes": (1, True), "max_lease_seconds": (0, False),
                 "body_timeout": (0, False), "header_timeout": (0, False), "canary_top_k": (0, True),
                 "canary_tolerance": (0, True),
                 "canary_cross_tolerance": (0, True), "canary_exact_tolerance": (0, True)}


def _check_ranges(section: dict, ranges: dict, where: str, source: str) -> None:
    for key, (low, inclusive) in ranges.items():
        value = section[key]
        if value < low or (value == low and not inclusive):
            bound = f"at least {low}" if inclusive else f"more than {low}"
            raise ConfigError(f"{source}: {where}.{key} must be {bound}, got {value}", field=f"{where}.{key}")


def check_limits(client: dict, server: dict, source: str) -> None:
    """Range checks of the client and server sections, and the timeouts that must agree with each other."""
    _check_ranges(client, CLIENT_RANGES, "client", source)
    if client["route"] not in routing.MODES:
        raise ConfigError(f"{source}: client.route must be one of {', '.join(routing.MODES)}, got {client['route']!r}",
                          field="client.route")
    if client["handoff_mode"] not in HANDOFF_MODES:
        raise ConfigError(f"{source}: client.handoff_mode must be one of {', '.join(HANDOFF_MODES)}, "
                          f"got {client['handoff_mode']!r}", field="client.handoff_mode")
    _check_ranges(server, SERVER_RANGES, "server", source)
    if server["openmp_wait"] not in OPENMP_WAITS:
        raise ConfigError(f"{source}: server.openmp_wait must be one of {', '.join(OPENMP_WAITS)}, "
                          f"got {server['openmp_wait']!r}", field="server.openmp_wait")
    for entry in server["kv_sources"]:
        if not isinstance(entry, str) or not entry:
            raise ConfigError(f"{source}: server.kv_sources must be a list of host, host:port or URL strings",
                              field="server.kv_sources")
    for entry in server["canary_pairs"]:
        tolerance = entry.get("tolerance") if isinstance(entry, dict) else None
        if (not isinstance(entry, dict) or set(entry) != {"prefill", "decode", "tolerance"}
                or not all(isinstance(entry[k], str) for k in ("prefill", "decode"))
                or isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or tolerance < 0):
            raise ConfigError(f"{source}: server.canary_pairs must be a list of {{\"prefill\": ENGINE, \"decode\": "
                              f"ENGINE, \"tolerance\": NUMBER >= 0}} objects, got {json.dumps(entry)}",
                              field="server.canary_pairs")
    if server["kv_progress_timeout"] > server["kv_fetch_timeout"]:
        raise ConfigError(f"{source}: server.kv_progress_timeout ({server['kv_progress_timeout']}) must not exceed "
                          f"server.kv_fetch_timeout ({server['kv_fetch_timeout']})", field="server.kv_progress_timeout")
    if client["decode_timeout"] <= server["kv_fetch_timeout"]:
        # the decode server may take kv_fetch_timeout to pull the KV: a client that gives up first
        # would blame (and mark down) a healthy decode server for a slow prefill server
        raise ConfigError(f"{source}: client.decode_timeout ({client['decode_timeout']}) must exceed "
                          f"server.kv_fetch_timeout ({server['kv_fetch_timeout']})", field="client.decode_timeout")

# The production roles' names, used when a config has no "models" section.
DEFAULT_ALIASES = {
    "qwen": ["qwen3-coder:30b", "qwen3-coder"],
    "gpt-oss": ["gpt-oss:120b", "gpt-oss-120b"],
}
# The production model of each documents' key (the first alias): what an Ollama server asks its
# daemon for when its model entry names no model, as in the documents' config shape.
PRODUCTION_MODELS = {key: names[0] for key, names in DEFAULT_ALIASES.items()}


def is_loopback(host: str) -> bool:
    """Whether a host (or a bind address's host) is reachable from this machine only."""
    import ipaddress

    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


@dataclass
class ServerEntry:
    role: str  # "prefill" or "decode"
    name: str
    host: str
    port: int
    model: str  # the key of a model entry
    settings: dict = field(default_factory=dict)  # model settings merged with this server's overrides
    data_url: str | None = None  # where peers fetch KV bundles, if not http://host:port
    power_watts: float | None = None  # the machine's draw under load, watts (disagg bench's estimate)
    cost_per_hour: float | None = None  # the machine's hardware, amortised, per hour (disagg bench)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def machine(self) -> str:
        """The machine the server runs on, as far as the config tells: its host, every loopback name as one."""
        return "loopback" if is_loopback(self.host) else self.host


@dataclass
class ClusterConfig:
    models: dict
    prefill_servers: list
    decode_servers: list
    client: dict
    server: dict
    source: str = "<dict>"
    gateway: dict = field(default_factory=lambda: dict(GATEWAY_DEFAULTS))

    @property
    def servers(self) -> list:
        return self.prefill_servers + self.decode_servers

    def resolve_model(self, name: str) -> str:
        """The model key for a name or alias ('qwen3-coder:30b' -> 'qwen')."""
        if name in self.models:
            return name
        lowered = name.lower()
        for key, entry in self.models.items():
            if lowered == key.lower() or lowered in (a.lower() for a in entry.get("aliases", [])):
                return key
        known = sorted(set(self.models) | {a for e in self.models.values() for a in e.get("aliases", [])})
        from .errors import ModelNotFound

        raise ModelNotFound(f"unknown model {name!r}; configured: {', '.join(known)}", field="model")

    def find_server(self, name: str) -> ServerEntry:
        for entry in self.servers:
            if entry.name == name:
                return entry
        raise ConfigError(f"{self.source}: no server named {name!r} (have: {', '.join(s.name for s in self.servers)})")


def _type_name(expected) -> str:
    if isinstance(expected, tuple):
        return " or ".join(t.__name__ for t in expected)
    return expected.__name__


def _check_keys(obj, spec: dict, where: str, source: str, required=()) -> None:
    if not isinstance(obj, dict):
        raise ConfigError(f"{source}: {where} must be an object, got {type(obj).__name__}", field=where)
    for key in required:
        if key not in obj:
            raise ConfigError(f"{source}: {where}.{key} is required", field=f"{where}.{key}")
    for key, value in obj.items():
        if key not in spec:
            raise ConfigError(
                f"{source}: unknown key {where}.{key} (expected one of: {', '.join(sorted(spec))})",
                field=f"{where}.{key}",
            )
        expected = spec[key]
        if value is None and key == "api_token":
            continue
        ok = isinstance(value, expected) and not (expected in (int, (int, float)) and isinstance(value, bool))
        if not ok:
            raise ConfigError(
                f"{source}: {where}.{key} must be {_type_name(expected)}, got {json.dumps(value)}",
                field=f"{where}.{key}",
            )


def _engine_of(entry: dict, where: str, source: str, default: str) -> tuple[str, type]:
    """The name and settings class of the engine an entry runs (its ``backend``, or ``default``)."""
    backend = entry.get("backend", default)
    if not isinstance(backend, str):
        raise ConfigError(f"{source}: {where}.backend must be str, got {json.dumps(backend)}", field=f"{where}.backend")
    if not backends.is_registered(backend):
        raise ConfigError(f"{source}: {where}.backend must be a registered backend ({', '.join(backends.names())}), "
                          f"got {backend!r}", field=f"{where}.backend")
    return backend, backends.settings_class(backend)


def _check_options(entry: dict, engine: tuple[str, type], own: dict, where: str, source: str) -> None:
    """Check an entry's keys: its own (``own``: key -> type) and the options its engine (name, settings
    class) declares. A key that is an option of another engine only is checked as that option, then refused."""
    backend, declared = engine[0], options.declared(engine[1])
    _check_keys({k: v for k, v in entry.items() if k in own}, own, where, source)
    for key, value in entry.items():
        if key in own:
            continue
        option = declared.get(key) or _option_elsewhere(key)
        if option is None:
            raise ConfigError(f"{source}: unknown key {where}.{key} (expected one of: "
                              f"{', '.join(sorted({*own, *declared}))})", field=f"{where}.{key}")
        option.check(value, f"{where}.{key}", source)
        if key not in declared:
            raise ConfigError(f"{source}: {where}.{key} is not an option of the {backend} backend (its options: "
                              f"{', '.join(declared)})", field=f"{where}.{key}")


def _option_elsewhere(key: str):
    """The declaration of ``key`` by any registered engine that can be imported here, or None."""
    for name in backends.names():
        try:
            found = options.declared(backends.settings_class(name)).get(key)
        except ConfigError:
            continue
        if found is not None:
            return found
    return None


def _default_backend(model_entry: dict) -> str:
    """A model entry without ``backend`` runs llama.cpp when it names a model file, else Ollama (the documents'
    shape, where a model entry names none)."""
    return "llama_cpp" if "model" in model_entry else "ollama"


def _with_defaults(given, defaults: dict, where: str, source: str) -> dict:
    """Check a flat section against the types of its defaults (a None default means a string)."""
    spec = {k: str if v is None else (int, float) if isinstance(v, float) else (list, tuple) if isinstance(v, tuple) else type(v)
            for k, v in defaults.items()}
    _check_keys(given, spec, where, source)
    return {**defaults, **given}


def from_dict(data: dict, source: str = "<dict>") -> ClusterConfig:
    data = copy.deepcopy(data)
    top = {"models": dict, "prefill_servers": list, "decode_servers": list, "client": dict, "server": dict,
           "gateway": dict, "description": str}
    _check_keys(data, top, "config", source, required=("prefill_servers", "decode_servers"))

    models = data.get("models")
    if models is None:  # the documents' shape: model keys come from the servers, aliases from the defaults
        names = {s.get("model") for s in data["prefill_servers"] + data["decode_servers"] if isinstance(s, dict)}
        models = {n: {"aliases": list(DEFAULT_ALIASES.get(n, []))} for n in sorted(filter(None, names))}
    for key, entry in models.items():
        where = f"models.{key}"
        if not isinstance(entry, dict):
            raise ConfigError(f"{source}: {where} must be an object, got {type(entry).__name__}", field=where)
        _check_options(entry, _engine_of(entry, where, source, _default_backend(entry)), MODEL_ENTRY_KEYS, where,
                       source)
        for alias in entry.get("aliases", []):
            if not isinstance(alias, str):
                raise ConfigError(f"{source}: {where}.aliases must be a list of strings", field=f"{where}.aliases")

    client = _with_defaults(data.get("client", {}), CLIENT_DEFAULTS, "client", source)
    server = _with_defaults(data.get("server", {}), SERVER_DEFAULTS, "server", source)
    if server["non_temporal_copy_bytes"] != 0 and server["non_temporal_copy_bytes"] < MIN_NON_TEMPORAL_BYTES:
        raise ConfigError(f"{source}: server.non_temporal_copy_bytes must be 0 (glibc's default) or at least "
                          f"{MIN_NON_TEMPORAL_BYTES}, got {server['non_temporal_copy_bytes']}",
                          field="server.non_temporal_copy_bytes")
    check_limits(client, server, source)

    gateway = _with_defaults(data.get("gateway", {}), GATEWAY_DEFAULTS, "gateway", source)
    if not 0 < gateway["port"] < 65536:
        raise ConfigError(f"{source}: gateway.port must be 1..65535, got {gateway['port']}", field="gateway.port")

    entries = {"prefill": [], "decode": []}
    seen = set()
    for role in ("prefill", "decode"):
        for i, raw in enumerate(data[f"{role}_servers"]):
            where = f"{role}_servers[{i}]"
            if not isinstance(raw, dict):
                raise ConfigError(f"{source}: {where} must be an object, got {type(raw).__name__}", field=where)
            _check_keys({k: v for k, v in raw.items() if k in SERVER_ENTRY_KEYS}, SERVER_ENTRY_KEYS, where, source,
                        required=("host", "port", "model"))
            if not 0 < raw["port"] < 65536:
                raise ConfigError(f"{source}: {where}.port must be 1..65535, got {raw['port']}", field=f"{where}.port")
            for key in ("power_watts", "cost_per_hour"):
                if key in raw and not raw[key] >= 0:
                    raise ConfigError(f"{source}: {where}.{key} must be >= 0, got {raw[key]}", field=f"{where}.{key}")
            if raw["model"] not in models:
                raise ConfigError(f"{source}: {where}.model {raw['model']!r} is not a key of models "
                                  f"({', '.join(sorted(models))})", field=f"{where}.model")
            model_entry = models[raw["model"]]
            engine = _engine_of(raw, where, source, model_entry.get("backend") or _default_backend(model_entry))
            _check_options(raw, engine, SERVER_ENTRY_KEYS, where, source)
            name = raw.get("name") or f"{role}-{raw['model']}-{raw['host']}:{raw['port']}"
            if name in seen:
                raise ConfigError(f"{source}: {where}.name {name!r} is used twice", field=f"{where}.name")
            seen.add(name)
            # a server's "model" names a model entry; every other option it carries overrides that entry's
            settings = {k: v for k, v in model_entry.items() if k != "aliases"}
            settings.update({k: v for k, v in raw.items() if k not in SERVER_ENTRY_KEYS})
            settings.setdefault("backend", _default_backend(model_entry))
            if settings["backend"] == "ollama":  # the documents' key "qwen" asks Ollama for "qwen3-coder:30b"
                settings.setdefault("model", PRODUCTION_MODELS.get(raw["model"], raw["model"]))
            settings.setdefault("model", raw["model"])
            # the model entry's options for another engine do not apply to a server that runs this one
            settings = {k: v for k, v in settings.items() if k in options.declared(engine[1])}
            entries[role].append(ServerEntry(role, name, raw["host"], raw["port"], raw["model"], settings,
                                             raw.get("data_url"), _number(raw.get("power_watts")),
                                             _number(raw.get("cost_per_hour"))))
    return ClusterConfig(models, entries["prefill"], entries["decode"], client, server, source, gateway)


def _number(value) -> float | None:
    return None if value is None else float(value)


def find(path: str | os.PathLike) -> Path:
    """The file a config path names, in this order:

    1. the path as given;
    2. if that file is absent and the path is the design documents' spelling
       ``disaggregated_inference/config_current.json``, the ``config_current.json``
       of the directory that holds ``disaggregated_inference/`` (from the repository root: the
       repository's own file). There is one copy of the file; the loaded config's ``source``
       names the one read.
    """
    path = Path(path)
    if not path.exists() and path.name == DEFAULT_CONFIG_FILE and path.parent.name == "disaggregated_inference":
        beside = path.parent.parent / DEFAULT_CONFIG_FILE
        if beside.is_file():
            return beside
    return path


def load(path: str | os.PathLike | None = None) -> ClusterConfig:
    """Load and validate a config file (default: ``$DISAGG_CONFIG`` or ./config_current.json; see ``find``)."""
    path = find(path or os.environ.get("DISAGG_CONFIG") or DEFAULT_CONFIG_FILE)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    return from_dict(data, str(path))


def coerce(config) -> ClusterConfig:
    """Accept a ClusterConfig, a dict, a path, or None (``$DISAGG_CONFIG`` or ./config_current.json)."""
    if isinstance(config, ClusterConfig):
        return config
    if isinstance(config, dict):
        return from_dict(config)
    return load(config)
