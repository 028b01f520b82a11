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


def _caches(spec: dict[str, Any]) -> tuple[Any, Any, Any]:
    import numpy as np
    import torch

    g = torch.Generator().manual_seed(spec["seed"])
    src = torch.randint(-30000, 30000, tuple(spec["shape"]), generator=g,
                        dtype=torch.int16).view(torch.bfloat16)
    ref = np.ones(spec["nbytes"], dtype=np.uint8)
    return src, ref, torch.zeros_like(src)


def prefill_side(spec: dict[str, Any]) -> int:
    from kvrelay.relay.transports.nixl import NixlAgent, NixlTransport

    src, ref_src, _ = _caches(spec)
    p = NixlTransport()
    desc = p.register(src)
    ref = NixlAgent(f"{p.agent_name}-ref")
    ref.register(ref_src.ctypes.data, ref_src.nbytes, 0, "DRAM")
    print(json.dumps({"desc": {**desc, "metadata": desc["metadata"].hex()},
                      "ref_metadata": ref.metadata().hex(), "ref_addr": ref_src.ctypes.data}),
          flush=True)
    sys.stdin.read()  # serve until the bench closes our stdin
    ref.close()
    p.close()
    return 0


def decode_side(spec: dict[str, Any]) -> int:
    import numpy as np
    import torch

    from kvrelay.bench.transfer import paired
    from kvrelay.relay.transports.base import PeerInfo, TransferState
    from kvrelay.relay.transports.nixl import NixlAgent, NixlTransport

    offer = json.loads(sys.stdin.readline())
    src, _, dst = _caches(spec)
    ref_dst = np.zeros(spec["nbytes"], dtype=np.uint8)
    d = NixlTransport(dst)
    ref = NixlAgent(f"{d.agent_name}-ref")
    ref.register(ref_dst.ctypes.data, ref_dst.nbytes, 0, "DRAM")
    ref_name = ref.load_remote(bytes.fromhex(offer["ref_metadata"]))
    desc = {**offer["desc"], "metadata": bytes.fromhex(offer["desc"]["metadata"])}
    peer = PeerInfo("bench-p:0", "bench-p", desc)
    remote, local = spec["remote"], spec["local"]
    one_l = np.array([[ref_dst.ctypes.data, ref_dst.nbytes, 0]], dtype=np.uint64)
    one_r = np.array([[offer["ref_addr"], ref_dst.nbytes, 0]], dtype=np.uint64)

    def once() -> None:
        h = d.read(peer, "lease", "bench", remote, local)
        while (st := d.poll(h)).state is TransferState.PENDING:
            pass
        assert st.state is TransferState.DONE, st.error

    def ref_once() -> None:
        x = ref.read(ref_name, one_l, one_r, "DRAM", "DRAM")
        while (st := ref.state(x)) is TransferState.PENDING:
            pass
        ref.release(x)
        assert st is TransferState.DONE, "NIXL's reference READ failed"

    t, r = paired(once, ref_once, spec["repeats"])
    for lb, rb in zip(local, remote, strict=True):
        if not torch.equal(dst[lb].view(torch.int16), src[rb].view(torch.int16)):
            raise AssertionError(f"the nixl transport copied block {rb} -> {lb} wrongly")
    if not ref_dst.all():
        raise AssertionError("NIXL's reference READ left bytes unwritten")
    print(json.dumps({"t": [t.best, t.median], "ref": [r.best, r.median]}), flush=True)
    ref.close()
    d.close()
    return 0


def main(argv: list[str]) -> int:
    role, spec = argv[0], json.loads(argv[1])
    return prefill_side(spec) if role == "p" else decode_side(spec)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
