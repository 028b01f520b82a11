"""Unit tests of kvrelay.core."""
