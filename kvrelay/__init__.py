"""kvrelay: disaggregated LLM serving with an exactly-once KV lifecycle."""

__version__ = "0.1.0"
