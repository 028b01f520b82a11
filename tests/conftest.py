"""Session-wide test settings."""

import os

# The tests check bfloat16's results, not its speed: on a CPU without native bfloat16
# (an AVX2-only runner) `--dtype bfloat16` is refused unless this is set (loader.py,
# refuse_slow_bfloat16; test_cli_conventions checks the refusal). Subprocesses inherit it.
os.environ.setdefault("KVRELAY_ALLOW_SLOW_BF16", "1")
