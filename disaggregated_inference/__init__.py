"""Disaggregated LLM inference: prefill on one machine, decode on another, the KV cache in between.

Importing the package imports no model library; backends load theirs lazily.
"""
__version__ = "0.1.0"
