"""The engine core: pure and single-threaded. Requests and their lifecycle table, the scheduler,
the block pool (the one release path), the prefix cache, KV events, and the relay-facing port."""
