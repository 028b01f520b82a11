"""Usage errors and exit codes, the same in every command: 0 done; 1 the command ran and
failed (a port taken, a server that died); 2 the command line or what it names is
wrong, reported in one line as ``kvrelay COMMAND: what is wrong``."""

from __future__ import annotations

EXIT_FAILURE = 1
EXIT_USAGE = 2  # argparse's own code for a bad command line


class UsageError(Exception):
    """A mistake in the command line or in what it names: one line, exit 2."""
