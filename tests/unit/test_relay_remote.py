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
    with pytest.raises(KeyError):
        RemoteKv.from_dict({k: v for k, v in GOOD.items() if k != "lease_id"})
    with pytest.raises(ValueError):
        RemoteKv.from_dict(dict(GOOD, num_tokens="many"))
