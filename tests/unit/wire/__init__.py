"""Unit tests of kvrelay.wire."""
