"""One side of `kvrelay bench transfer`'s nixl run across network namespaces.

UCX keeps per-process state (its async thread, its netlink route lookups) in the
namespace where it first started, so each side runs in its own process, started in
its namespace with ``ip netns exec``:

    python -m kvrelay.bench.nixl_peer p SPEC   # prints one JSON line, waits for stdin EOF
    python -m kvrelay.bench.nixl_peer d SPEC   # reads P's line on stdin, prints timings

SPEC is JSON: cache shape, remote and local block ids, repeats, seed. Both sides build
the same source cache from the seed, so D checks every block it read.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _source(spec: dict[str, Any]) -> Any:
    import torch

    g = torch.Generator().manual_seed(spec["seed"])
    return torch.randint(-30000, 30000, tuple(spec["shape"]), generator=g,
                         dtype=torch.int16).view(torch.bfloat16)


def prefill_side(spec: dict[str, Any]) -> int:
    from kvrelay.relay.transports.nixl import NixlTransport

    p = NixlTransport()
    desc = p.register(_source(spec))
    print(json.dumps({**desc, "metadata": desc["metadata"].hex()}), flush=True)
    sys.stdin.read()  # serve until the bench closes our stdin
    p.close()
    return 0


def decode_side(spec: dict[str, Any]) -> int:
    import numpy as np
    import torch

    from kvrelay.bench.transfer import nixl_pair, paired
    from kvrelay.relay.transports.base import PeerInfo
    from kvrelay.relay.transports.nixl import NixlTransport

    offer = json.loads(sys.stdin.readline())
    src = _source(spec)
    dst = torch.zeros_like(src)
    ref_dst = np.zeros(spec["nbytes"], dtype=np.uint8)
    d = NixlTransport(dst)
    peer = PeerInfo("bench-p:0", "bench-p", {**offer, "metadata": bytes.fromhex(offer["metadata"])})
    remote, local = spec["remote"], spec["local"]
    once, ref_once = nixl_pair(d, peer, remote, local, ref_dst)
    t, r = paired(once, ref_once, spec["repeats"])
    for lb, rb in zip(local, remote, strict=True):
        if not torch.equal(dst[lb].view(torch.int16), src[rb].view(torch.int16)):
            raise AssertionError(f"the nixl transport copied block {rb} -> {lb} wrongly")
    flat = src.view(torch.uint8).reshape(-1)[: spec["nbytes"]].numpy()
    if not np.array_equal(ref_dst, flat):
        raise AssertionError("NIXL's reference READ copied wrongly")
    print(json.dumps({"t": [t.best, t.median], "ref": [r.best, r.median]}), flush=True)
    d.close()
    return 0


def main(argv: list[str]) -> int:
    role, spec = argv[0], json.loads(argv[1])
    return prefill_side(spec) if role == "p" else decode_side(spec)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
