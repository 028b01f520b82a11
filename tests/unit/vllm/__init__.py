"""Unit tests of kvrelay.vllm (the connector's vLLM-free halves)."""
