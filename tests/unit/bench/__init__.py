"""Unit tests of kvrelay.bench."""
