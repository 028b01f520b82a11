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


@pytest.mark.parametrize(("field", "value", "match"), [
    ("lease_id", "L" * (2 << 20), "lease_id has 2097152 characters; at most 300"),
    ("engine_id", "e" * 301, "engine_id has 301 characters; at most 300"),
    ("compat", "c" * 301, "compat has 301 characters; at most 300"),
    ("relay", "h" * 400 + ":9000", "relay has 405 characters; at most 300"),
    ("relay", "h\u00e9:9000", "a host name of letters"),
    ("relay", "h:\u0661\u0662", "relay must be host:port"),  # Unicode digits
    ("num_tokens", 2**31, "num_tokens must be >= 1 and <= 2147483647"),
    ("first_token", 2**40, r"outside this model's vocabulary \[0, 2147483647\)"),
    ("block_ids", [1, 2**40], "at most 2147483647"),
    ("block_ids", list(range(6)), "6 blocks, more than the 5 tokens"),
])
def test_every_field_a_client_writes_is_bounded(field: str, value: object, match: str) -> None:
    """Bug (issue 21): nothing bounded lease_id or engine_id: 2 MiB of either made D's
    ACQUIRE exceed the relay's frame limit (and killed its sender thread)."""
    with pytest.raises(ValueError, match=match):
        RemoteKv.from_client(dict(GOOD, **{field: value}))


def test_the_longest_params_allowed_make_a_small_frame() -> None:
    from kvrelay.relay import protocol as P

    kv = RemoteKv.from_client(dict(GOOD, lease_id="L" * 300, engine_id="e" * 300,
                                   compat="c" * 300, relay="h" * 253 + ":65535"))
    frame = P.encode(P.Acquire(2**31, kv.engine_id, kv.lease_id, "d" * 300, "a" * 16, 2**31))
    assert len(frame) < 2048 < P.MAX_FRAME


@pytest.mark.parametrize("spelling", ["h:5000", "h:05000", "h:0005000", "H:5000", "h.:5000",
                                      "[h]:5000"])
def test_spellings_of_one_relay_are_one_canonical_key(spelling: str) -> None:
    """Bug (issue 21): D keyed its connections, senders and data-socket pools by the
    relay as written: h:05000, h:005000, ... each took a socket and a thread."""
    assert RemoteKv.from_client(dict(GOOD, relay=spelling)).relay == "h:5000"


@pytest.mark.parametrize(("spelling", "canonical"), [
    ("127.0.0.1:09000", "127.0.0.1:9000"), ("[::1]:9000", "::1:9000"),
    ("0:0::1:9000", "::1:9000"), ("[0000::0001]:009000", "::1:9000"),
])
def test_ip_addresses_are_made_canonical(spelling: str, canonical: str) -> None:
    assert RemoteKv.from_client(dict(GOOD, relay=spelling)).relay == canonical
