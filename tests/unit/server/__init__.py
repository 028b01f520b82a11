"""Unit tests of kvrelay.server."""
