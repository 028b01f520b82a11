import pytest

from kvrelay.relay.remote import RemoteKv

GOOD = {"lease_id": "L", "relay": "127.0.0.1:9000", "engine_id": "p1", "block_ids": [1, 2],
        "num_tokens": 5, "first_token": 7, "compat": "c"}


def test_params_round_trip() -> None:
    kv = RemoteKv.from_client(GOOD)
    assert kv.relay == "127.0.0.1:9000" and kv.block_ids == [1, 2] and kv.first_token == 7


@pytest.mark.parametrize("relay", ["x", "host:", ":9000", "host:port", "host:0", "h:70000"])
def test_a_relay_that_is_not_host_port_is_refused(relay: str) -> None:
    # A forged address once reached the relay client and killed the engine loop.
    with pytest.raises(ValueError, match="relay must be host:port"):
        RemoteKv.from_client(dict(GOOD, relay=relay))


def test_missing_or_mangled_fields_raise() -> None:
    with pytest.raises(ValueError, match="'lease_id' is missing"):
        RemoteKv.from_dict({k: v for k, v in GOOD.items() if k != "lease_id"})
    for field, bad in (("num_tokens", "many"), ("num_tokens", "5"), ("first_token", 7.5),
                       ("first_token", True), ("block_ids", [1, "2"]), ("block_ids", 3),
                       ("lease_id", 12), ("relay", "")):
        with pytest.raises(ValueError, match=field):
            RemoteKv.from_dict(dict(GOOD, **{field: bad}))
    with pytest.raises(ValueError, match="expected an object"):
        RemoteKv.from_dict([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(("change", "match"), [
    ({"first_token": 49152}, "outside this model's vocabulary"),
    ({"first_token": -1}, "outside this model's vocabulary"),
    ({"num_tokens": 0}, "num_tokens must be >= 1"),
    ({"block_ids": [1, 1]}, "distinct"),
    ({"block_ids": [-1, 2]}, "distinct non-negative"),
    ({"block_ids": [1, 2, 3]}, "need 2"),
    ({"num_tokens": 9}, "need 3"),
])
def test_params_are_validated_in_full_before_admission(change: dict, match: str) -> None:
    # A forged first token outside the vocabulary once killed the decode engine's loop.
    with pytest.raises(ValueError, match=match):
        RemoteKv.from_client(dict(GOOD, **change), vocab_size=49152, block_size=4)
    RemoteKv.from_client(GOOD, vocab_size=49152, block_size=4)
