"""P: leases by a key the proxy chose before they existed.

The proxy cancels its prefill call when its client leaves. If P had already made the
lease and was writing its answer, the proxy never reads the lease id, so it cannot
give the lease back (``POST /v1/kv/release``) and the lease would be held until it
expires (``kvrelay bench chaos --leave wait_p``: 32 of 214 leases expired). So the
proxy names each prefill call with a random ``release_key`` (in ``kv_transfer_params``)
and, whenever a call ends without an answer it read, releases by that key. Either
order works:

- the lease was made first: ``release`` finds it and the caller releases it now;
- the release came first (P still prefilling, its answer not applied yet): the key is
  remembered, and ``made`` says to release the lease at once when it comes.

Pure (a clock is passed in); the HTTP server calls it on its event loop only. Both
maps are bounded (``cap`` entries, the oldest dropped) and aged (``ttl``, the lease
acquire timeout: an older lease was pulled or has expired), so keys a client writes
size nothing: a dropped entry only means a lease that expires instead.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kvrelay.relay.port import LeaseHandle as Lease

KEY_RE = re.compile(r"[A-Za-z0-9_-]{16,64}")
DEFAULT_CAP = 4096


def check_key(key: Any) -> str:
    """The key, or ValueError naming what is allowed."""
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise ValueError("release_key must be a string of 16 to 64 characters from "
                         f"A-Z a-z 0-9 _ -; got {str(key)[:80]!r}")
    return key


class ReleaseKeys:
    def __init__(self, *, ttl: float, clock: Callable[[], float],
                 cap: int = DEFAULT_CAP) -> None:
        if ttl <= 0 or cap < 1:
            raise ValueError(f"ttl must be > 0 and cap >= 1, got {ttl}, {cap}")
        self.ttl, self.cap, self.clock = ttl, cap, clock
        self._leases: OrderedDict[str, tuple[float, Lease]] = OrderedDict()
        self._released: OrderedDict[str, float] = OrderedDict()  # released before made

    def __len__(self) -> int:
        return len(self._leases) + len(self._released)

    def made(self, key: str, lease: Lease) -> bool:
        """A lease was made under ``key``: True when it is to be released now (its key
        was released first); otherwise it is remembered."""
        now = self._age()
        if self._released.pop(key, None) is not None:
            return True
        self._put(self._leases, key, (now, lease))
        return False

    def release(self, key: str) -> Lease | None:
        """The lease made under ``key``, to be released now; None when it
        is not made yet (a lease made later under it is released at once)."""
        now = self._age()
        entry = self._leases.pop(key, None)
        if entry is not None:
            return entry[1]
        self._put(self._released, key, now)
        return None

    def _put(self, into: OrderedDict[str, Any], key: str, value: Any) -> None:
        into.pop(key, None)
        into[key] = value
        while len(into) > self.cap:
            into.popitem(last=False)

    def _age(self) -> float:
        """Drop entries older than ``ttl`` (oldest first: O(1) per entry dropped)."""
        now = self.clock()
        while self._leases and next(iter(self._leases.values()))[0] <= now - self.ttl:
            self._leases.popitem(last=False)
        while self._released and next(iter(self._released.values())) <= now - self.ttl:
            self._released.popitem(last=False)
        return now
