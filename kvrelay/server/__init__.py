"""One engine behind HTTP (`kvrelay serve`): the OpenAI routes, the engine loop thread, the
prefill and decode roles, lease routes, metrics."""
