"""Leases on prefilled bundles: expiry, release after fetch, the reason a handle is gone."""
import pytest

from disaggregated_inference.errors import LeaseExpired, NotFound
from disaggregated_inference.kv.lease import LeaseTable


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Header:
    def __init__(self, n):
        self.payload_bytes = n


def table(ttl=30.0):
    clock = Clock()
    return LeaseTable(ttl_seconds=ttl, sweep_every=0, clock=clock), clock


def test_lease_expires_and_its_payload_reference_is_dropped():
    leases, clock = table(ttl=5)
    payload = bytearray(1000)
    lease = leases.put(Header(1000), [1, 2], payload)
    assert leases.stats()["bytes"] == 1000 and leases.stats()["held"] == 1
    clock.now += 5.01
    assert leases.stats() == {"held": 0, "bytes": 0, "ttl_seconds": 5.0, "expired_total": 1, "fetched_total": 0}
    with pytest.raises(LeaseExpired, match="expired before it was fetched"):
        leases.get(lease.handle)
    assert leases._leases == {}  # the table no longer references the payload


def test_released_lease_is_gone_with_a_reason():
    leases, _ = table()
    lease = leases.put(Header(10), [1], bytes(10))
    assert leases.get(lease.handle) is lease
    leases.release(lease.handle)
    with pytest.raises(NotFound, match="already fetched"):
        leases.get(lease.handle)
    assert leases.stats()["fetched_total"] == 1


def test_unknown_handle_is_404_naming_it():
    leases, _ = table()
    with pytest.raises(NotFound, match="unknown KV handle 'nope'") as info:
        leases.get("nope")
    assert info.value.field == "handle"


def test_per_request_ttl_and_unguessable_handles():
    leases, clock = table(ttl=30)
    short = leases.put(Header(1), [1], b"x", ttl_seconds=1)
    long = leases.put(Header(1), [1], b"x")
    assert short.handle != long.handle and len(short.handle) >= 20
    clock.now += 2
    assert leases.get(long.handle) is long
    with pytest.raises(LeaseExpired):
        leases.get(short.handle)


def test_sweeper_thread_expires_leases_without_any_request():
    import time

    leases = LeaseTable(ttl_seconds=0.2, sweep_every=0.05)
    leases.put(Header(5), [1], b"12345")
    deadline = time.time() + 3
    while leases.expired_total == 0 and time.time() < deadline:
        time.sleep(0.05)
    assert leases.expired_total == 1
    leases.close()
