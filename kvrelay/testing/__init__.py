"""Test doubles shared by the tests, the simulators and the benchmarks: fake runners, tiny
models written through the real loaders, KV fixtures. Never imported by serving code."""
