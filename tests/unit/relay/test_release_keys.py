"""The prefill engine's leases by the proxy's release_key (kvrelay.relay.release_keys)."""

from __future__ import annotations

import pytest

from kvrelay.relay.release_keys import ReleaseKeys, check_key

KEY = "k" * 22


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def lease(n: int) -> dict[str, str]:
    return {"engine_id": "e", "lease_id": f"lease-{n}"}


def test_a_lease_made_first_is_handed_to_the_release_once() -> None:
    keys = ReleaseKeys(ttl=30, clock=Clock())
    assert keys.made(KEY, lease(1)) is False
    assert keys.release(KEY) == lease(1)
    assert len(keys) == 0
    # A second release of the same key finds nothing and remembers it (pending).
    assert keys.release(KEY) is None


def test_a_release_first_makes_the_lease_released_as_soon_as_it_is_made() -> None:
    keys = ReleaseKeys(ttl=30, clock=Clock())
    assert keys.release(KEY) is None
    assert keys.made(KEY, lease(1)) is True
    assert len(keys) == 0  # the tombstone is used up
    assert keys.made(KEY, lease(2)) is False  # a later lease under it is kept


def test_entries_age_out_after_the_ttl_and_the_maps_are_capped() -> None:
    clock = Clock()
    keys = ReleaseKeys(ttl=30, clock=clock, cap=3)
    for i in range(5):
        keys.made(f"{KEY}{i}", lease(i))
        keys.release(f"{KEY}r{i}")
    assert len(keys) == 6  # three of each: the oldest dropped
    assert keys.release(f"{KEY}0") is None  # dropped: the lease would expire instead
    assert keys.release(f"{KEY}4") == lease(4)
    clock.t = 30.0
    keys.release("z" * 20)  # any call ages out what is older than the ttl
    assert len(keys) == 1


@pytest.mark.parametrize("bad", ["", "short", "x" * 65, "no spaces allowed here", 7, None,
                                 ["k" * 20]])
def test_a_key_outside_the_alphabet_or_length_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="release_key must be a string of 16 to 64"):
        check_key(bad)
    assert check_key("A-z_0" * 4) == "A-z_0" * 4
