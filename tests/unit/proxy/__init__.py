"""Unit tests of kvrelay.proxy."""
