"""Which hosts a decode server pulls KV bundles from.

A ``/decode`` request names the URL of its KV bundle, and a decode server
would otherwise fetch whatever it is told (an internal URL, a crafted blob)
and send its bearer token along. It fetches only from a *source* its settings
name: the prefill servers of its cluster (their ``data_url``, or
``http://host:port``: ``ServerSettings.kv_peers``) and the explicit allow-list
``server.kv_sources``.

A source is written ``host``, ``host:port`` or a URL (``http://host:port/prefix``).
A bare ``host`` allows any port of that host; a URL also fixes the scheme and
the path prefix. Host names are compared as written, lowercased (no DNS):
``localhost`` does not match ``127.0.0.1``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable
from urllib.parse import urlsplit

from ..errors import Forbidden


@dataclass(frozen=True)
class Source:
    host: str
    port: int | None = None
    scheme: str | None = None
    path: str = ""

    @classmethod
    def parse(cls, text: str) -> "Source":
        url = urlsplit(text if "://" in text else f"//{text}")
        if not url.hostname:
            raise ValueError(f"not a host, host:port or URL: {text!r}")
        return cls(url.hostname.lower(), url.port, url.scheme.lower() or None, url.path.rstrip("/"))

    def admits(self, url) -> bool:
        port = url.port or (443 if url.scheme == "https" else 80)
        return ((url.hostname or "").lower() == self.host
                and (self.port is None or self.port == port)
                and (self.scheme is None or self.scheme == url.scheme.lower())
                and (not self.path or url.path == self.path or url.path.startswith(self.path + "/")))


def check_source(url: str, sources: Iterable[str]) -> None:
    """Raise ``Forbidden`` (403, field ``kv.url``) unless ``url`` lies on one of ``sources``."""
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        raise Forbidden("'kv.url' has an invalid port", field="kv.url") from None
    if not any(Source.parse(s).admits(parts) for s in sources):
        raise Forbidden("'kv.url' is not on a prefill server this decode server trusts (the cluster's prefill "
                        "servers and server.kv_sources)", field="kv.url")
