"""The proxy: its own process (``kvrelay proxy``), one OpenAI-compatible front that splits each
request into legs through prefill and decode engines and answers as one server."""
