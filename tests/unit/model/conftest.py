"""Fixtures shared by the native-kernel tests (test_model_native_kernels.py,
test_one_answer.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvrelay.model.kernels import ext

_mod = ext.load()
_best = _mod.isa() if _mod is not None else "none"
ISAS = ["avx512", "avx2"] if _best == "avx512" else [_best]


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each ISA path this CPU has (AVX-512 and AVX2, or AVX2 alone), set for the test and
    set back to the best after it."""
    assert _mod is not None
    assert _mod.set_isa(request.param)
    yield request.param
    _mod.set_isa(_best)
