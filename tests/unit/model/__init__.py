"""Unit tests of kvrelay.model."""
