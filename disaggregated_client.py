"""The orchestrator client, importable from the repository root as the design documents use it.

    from disaggregated_client import DisaggregatedClient
    client = DisaggregatedClient("config_current.json")
    text, metrics = client.generate(model="qwen3-coder:30b", prompt="...", max_tokens=200)
"""
from disaggregated_inference.client import DisaggregatedClient, FallbackWarning  # noqa: F401
from disaggregated_inference.errors import DisaggError, NoServerAvailable  # noqa: F401

__all__ = ["DisaggregatedClient", "FallbackWarning", "DisaggError", "NoServerAvailable"]
