"""What the engine server and the proxy both speak: OpenAI request models and error bodies,
SSE, tool calls, the KV-events codec, the graceful server and drain. No engine or model state."""
