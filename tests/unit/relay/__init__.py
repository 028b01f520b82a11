"""Unit tests of kvrelay.relay (and its transports)."""
