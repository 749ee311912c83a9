"""The KV cache on its way between machines: the bundle wire format, buffers, leases, sending,
receiving, and the fingerprint that says what produced it.

``bundle`` stands alone (standard library and ``crc32c`` only).
"""
