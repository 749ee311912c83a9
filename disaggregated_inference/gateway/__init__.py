"""The gateway: the cluster behind the OpenAI and Ollama HTTP APIs (``disagg gateway``)."""
