"""Deterministic simulators (`python -m kvrelay.sim engine|pd`): the production core and relay
driven by a seeded clock, network and fault policy; a failing seed prints its replay."""
