"""The twelve race scenarios of DESIGN section 7, each driving its exact interleaving.

Every test says what the naive design did and what the assertion would catch.
Plus: duplicated, late, reordered and dropped relay messages, D crash, P restart.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
import torch

from kvrelay.config import SchedulerConfig
from kvrelay.core.block_pool import BlockPool
from kvrelay.core.engine import Engine
from kvrelay.core.kv_port import EngineKvLoads, PoolLeaseBlocks
from kvrelay.core.lifecycle import FinishReason, RequestState
from kvrelay.core.scheduler import RequestRejected
from kvrelay.relay import protocol as P
from kvrelay.relay.lease import LeaseState, LeaseTable, ReleaseReason
from kvrelay.relay.prefill import PrefillRelay
from kvrelay.relay.receiver import Phase, Policy, Receiver, ReceiverConfig, RemoteKv
from kvrelay.relay.transports.base import PeerInfo, TransferState, TransferStatus
from kvrelay.relay.transports.tcp import TcpTransport
from kvrelay.sampling_params import SamplingParams
from kvrelay.sim.pd_world import SimKv, SimRunner, Violation
from kvrelay.testing.fake_runner import kv_tags
from kvrelay.testing.kv import TINY_GEOMETRY, TensorFakeRunner, kv_shape
from tests.sim.race_harness import NBLOCKS, VOCAB, Pair


def decoded(pair: Pair, rid: str, kv: RemoteKv) -> list[int]:
    return [kv.first_token, *pair.outputs[rid]]


def test_race01_done_before_the_lease_timer_is_armed() -> None:
    """Mooncake connector: D's done arrived before P armed the timer; the timer then
    fired on a released request and freed it twice. Here creating the lease arms
    its deadline in the same call, and a released lease's heap entry is dead.

    Three real threads, as in the server: the engine creating leases in its steps,
    a relay thread acquiring and committing each lease the instant it appears, and an
    expiry thread racing both with a deadline of 0.1 ms. Each lease is released once,
    by whichever came first, and the pool balances."""
    lock = threading.Lock()
    pool = BlockPool(NBLOCKS)
    table = LeaseTable(PoolLeaseBlocks(pool), engine_id="p1", acquire_timeout=1e-4,
                       hard_cap=10.0)
    relay = PrefillRelay(table, address="p", compat="c", clock=time.monotonic)
    engine = Engine(SchedulerConfig(num_blocks=NBLOCKS, block_size=4),
                    SimRunner(SimKv(NBLOCKS, 4), pool, VOCAB), pool=pool,
                    kv_handoff=relay.kv_handoff)
    stop = threading.Event()
    errors: list[BaseException] = []
    verdicts: dict[str, str] = {}

    def guarded(fn: Any) -> Any:
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # reported below, never lost in a thread
                errors.append(e)
                stop.set()
        return run

    def engine_thread() -> None:
        for i in range(40):
            with lock:
                engine.add_request(f"r{i}", list(range(1, 10)), SamplingParams(max_tokens=4),
                                   remote_decode=True)
            while engine.has_work():
                with lock:
                    engine.step()

    def relay_thread() -> None:
        while not stop.is_set():
            with lock:
                taken, relay.kv_params = relay.kv_params, {}
                for params in taken.values():
                    now = time.monotonic()
                    table.acquire("p1", params.lease_id, "d1", "a1", now)
                    ans = table.release("p1", params.lease_id, "d1", "a1", True, now)
                    verdicts[params.lease_id] = ans.reason.value if ans.reason else ""

    def expiry_thread() -> None:
        while not stop.is_set():
            with lock:
                table.expire(time.monotonic())

    threads = [threading.Thread(target=guarded(f)) for f in (relay_thread, expiry_thread)]
    for t in threads:
        t.start()
    guarded(engine_thread)()
    deadline = time.monotonic() + 10
    while len(verdicts) < 40 and not errors and time.monotonic() < deadline:
        time.sleep(0.001)
    stop.set()
    for t in threads:
        t.join(5)
    assert not errors, errors
    assert len(verdicts) == 40 and set(verdicts.values()) <= {"done", "expired"}
    with lock:
        table.expire(time.monotonic() + 1.0)
    assert table.stats.created == 40 == sum(table.stats.released.values())
    assert table.next_deadline() is None and not table.leases
    pool.check_integrity()
    assert pool.num_free == NBLOCKS


def test_race02_done_arrives_after_the_lease_expired() -> None:
    """A late done after expiry crashed P (the request was gone). Here it is answered
    with the release reason, counted as stale, and D discards its copy."""
    pair = Pair(acquire=1.0)
    kv, h = pair.start_copy()
    pair.transport.land(h)
    pair.transport.finish(h)
    pair.tick()  # D sends RELEASE(ok); it is slow on the wire
    pair.now = 2.0
    assert [x.lease_id for x in pair.table.expire(pair.now)] == [kv.lease_id]
    (reply,) = pair.deliver_to_p()
    assert reply.status == "released" and reply.reason == "expired"
    assert pair.table.stats.stale_messages == 1 and pair.table.stats.fence_failures == 1
    pair.deliver_to_d()
    assert pair.rx.stats.fallbacks == {"fence_failed": 1}
    pair.converse()
    assert decoded(pair, "r", kv) == pair.expect(1)  # recomputed locally
    pair.assert_all_free()


@pytest.mark.parametrize("p_async", [True, False])
def test_race03_abort_in_an_inflight_step_while_kv_is_sent(p_async: bool) -> None:
    """vLLM: a request finished while in an async step and held for sending was freed
    by both the abort and the send completion. Here (a) an abort during the in-flight
    prefill step keeps the blocks until the step completes, then frees them once and
    creates no lease; (b) an abort after the hand-off is a stale no-op at the engine:
    the lease alone frees the blocks, once."""
    pair = Pair(p_async=p_async)
    pair.p.add_request("a", pair.prompt(9), pair.params(1), remote_decode=True)
    batch = pair.p.schedule()
    assert batch is not None
    req = pair.p.requests["a"]
    assert pair.p.abort_request("a")
    assert req.state is RequestState.FINISHING and pair.p_pool.owned_count(req.owner) == 3
    pair.p.complete(batch, pair.p.runner.execute(batch))
    assert pair.p_pool.num_free == NBLOCKS and pair.table.stats.created == 0
    kv = pair.prefill("b", seed=2)
    assert not pair.p.abort_request("b")  # already handed to the lease
    assert pair.p.stats.stale_events == 1
    assert pair.table.abort("p1", kv.lease_id, pair.now).ok  # the proxy's abort
    assert pair.table.abort("p1", kv.lease_id, pair.now).status.value == "released"
    assert pair.p_pool.num_free == NBLOCKS


def test_race04_abort_while_loading_drains_before_freeing() -> None:
    """Abort while the transfer writes into our blocks: freeing at once let the
    transfer scribble into blocks reused by another request. Here the request is
    DRAINING and its blocks stay its own until the transport stops writing."""
    pair = Pair()
    _, h = pair.start_copy()
    pair.transport.land(h, 1)
    pair.rx.abort("r", pair.now)
    req = pair.d.requests["r"]
    assert req.state is RequestState.DRAINING and h.cancelled
    assert pair.d_pool.owned_count(req.owner) == 3  # not reusable yet
    pair.transport.land(h, 1)  # a block in flight still lands: into our own block
    pair.tick()
    assert req.state is RequestState.DRAINING
    pair.transport.finish(h, ok=False)
    pair.tick()
    assert "r" not in pair.d.requests and pair.d_pool.num_free == NBLOCKS
    assert [type(m) for m in pair.outbox] == [P.Abort]
    pair.converse()
    assert pair.table.stats.released == {"aborted": 1}
    pair.assert_all_free()


def test_race05_received_and_sent_reported_in_the_same_step() -> None:
    """vLLM: finished_recving and finished_sending for one request in one step were
    both processed and freed it twice. Here the copy's end, P's verdict and a
    duplicate of it all arrive before one tick: one load_done, one release."""
    pair = Pair()
    kv, h = pair.start_copy()
    pair.transport.land(h)
    pair.transport.finish(h)
    pair.tick()
    (verdict,) = pair.deliver_to_p()
    pair.replies.append(verdict)  # duplicated on the wire
    pair.deliver_to_d()
    assert pair.rx.stats.loaded == 1 and pair.rx.stats.stale_replies == 1
    pair.converse()
    assert decoded(pair, "r", kv) == pair.expect(1)
    assert pair.table.stats.released == {"done": 1}
    pair.assert_all_free()


def _expire_and_reuse(pair: Pair) -> None:
    """P's lease expires mid-copy and another request takes the freed blocks."""
    pair.now = 2.0
    pair.table.expire(pair.now)
    pair.p.add_request("other", [5] * 12, pair.params(9, 1))
    while pair.p.has_work():
        pair.p.step()


def test_race06_expiry_while_reading_is_caught_by_the_fence() -> None:
    """vLLM: P freed the blocks while D still read them; D decoded the torn copy
    and produced wrong output. Here the copy is torn for real (P reuses the
    blocks for another request mid-copy); RELEASE(ok) is refused and D recomputes."""
    pair = Pair(acquire=1.0)
    kv, h = pair.start_copy("r", prompt_len=12)
    pair.transport.land(h, 1)
    _expire_and_reuse(pair)
    pair.transport.land(h)
    pair.transport.finish(h)
    # The naive design decodes now: the copied KV is someone else's.
    req = pair.d.requests["r"]
    runner = pair.d.runner
    assert isinstance(runner, SimRunner)
    torn = [pair.d_kv.block(b) for b in req.block_ids]
    tags = kv_tags(Pair.prompt(12))
    assert torn != [[tags[4 * i + j] for j in range(4)] for i in range(3)]
    pair.tick()
    pair.deliver_to_p()
    pair.deliver_to_d()
    assert pair.rx.stats.fence_failures == 1 and pair.rx.stats.fallbacks == {"fence_failed": 1}
    pair.converse()
    assert decoded(pair, "r", kv) == pair.expect(1, prompt_len=12)
    pair.assert_all_free()


@pytest.mark.parametrize("expired", [False, True])
def test_race06_the_verdict_after_the_bytes_is_the_fence(expired: bool) -> None:
    """The same race with the commit carried by the READ (tcp, Read.commit): P's
    verdict arrives with the transfer's end, and only ``done`` lets D decode. An expiry
    and reuse under the copy gets ``released`` and D recomputes; D sends no RELEASE of
    its own either way (the READ told P), and P released the lease once."""
    pair = Pair(acquire=1.0)
    kv, h = pair.start_copy("r", prompt_len=12)
    pair.transport.land(h, 1)
    if expired:
        _expire_and_reuse(pair)
    pair.transport.land(h)
    load = pair.rx.loads["r"]
    commit = P.Release(7, kv.engine_id, kv.lease_id, "d1", load.attempt, True)
    h.status = TransferStatus(TransferState.DONE, nbytes=h.landed * 4,
                              verdict=pair.relay.handle(commit, pair.now))
    pair.outbox.clear()  # heartbeats
    pair.tick()
    assert pair.outbox == [] and load.phase is Phase.DONE
    assert pair.table.stats.released == {"expired" if expired else "done": 1}
    if expired:
        assert pair.rx.stats.fallbacks == {"fence_failed": 1}
        assert pair.d.requests["r"].state is not RequestState.RUNNING
    else:
        assert pair.rx.stats.loaded == 1 and not pair.rx.stats.fallbacks
    pair.converse()
    assert decoded(pair, "r", kv) == pair.expect(1, prompt_len=12)
    pair.assert_all_free()


def test_race07_rejected_before_admission_tells_prefill_at_once() -> None:
    """Without a word from D, P held the blocks until a timeout (or forever)."""
    pair = Pair(d_max_len=12)
    kv = pair.prefill("r", max_tokens=30)
    with pytest.raises(RequestRejected, match="maximum context length"):
        pair.submit("r", kv, max_tokens=30)
    assert [type(m) for m in pair.outbox] == [P.Abort]
    pair.deliver_to_p()
    pair.deliver_to_d()
    assert pair.table.stats.released == {"aborted": 1}
    pair.assert_all_free()


def test_race08_nothing_to_pull_is_still_reported() -> None:
    """D already holds the whole prompt in its prefix cache: the naive receiver never
    told P, whose blocks leaked until a timeout. Here D still acquires the lease (P
    frees every block at that ACQUIRE, and its answer checks D's params) and commits
    an empty copy; nothing is read."""
    pair = Pair(caching=True)
    warm = pair.prefill("warm", prompt_len=8)  # two full blocks, now cached on D
    pair.submit("warm", warm, prompt_len=8)
    pair.converse()
    kv = pair.prefill("r", prompt_len=8)
    pair.submit("r", kv, prompt_len=8)
    pair.step_d()
    assert [type(m) for m in pair.outbox] == [P.Acquire]
    pair.deliver_to_p()
    assert not pair.table.leases[kv.lease_id].block_ids  # all released at ACQUIRE
    pair.deliver_to_d()
    assert [type(m) for m in pair.outbox] == [P.Release] and len(pair.transport.handles) == 1
    pair.converse()
    assert decoded(pair, "r", kv) == pair.expect(1, prompt_len=8)
    assert pair.table.stats.released == {"done": 2}
    pair.assert_all_free()


def test_race09_only_delayed_release_requests_remain() -> None:
    """The engine loop stopped when no request was runnable, leaving a draining
    request (and its blocks) forever. Here has_work stays true until it settles,
    and P's leases settle by deadline with P's engine idle."""
    pair = Pair(acquire=1.0)
    kv = pair.prefill("r")
    idle_lease = pair.prefill("s", seed=2)
    assert not pair.p.has_work() and len(pair.table.leases) == 2
    pair.submit("r", kv)
    pair.step_d()
    pair.deliver_to_p(keep=0)
    pair.deliver_to_d()
    pair.rx.abort("r", pair.now)
    assert pair.d.schedule() is None  # nothing to run...
    assert pair.d.has_work() and pair.rx.has_work()  # ...but not done
    pair.converse()
    pair.now = 2.0
    assert [x.lease_id for x in pair.table.expire(pair.now)] == [idle_lease.lease_id]
    pair.assert_all_free()


@pytest.mark.parametrize("d_async", [True, False])
def test_race10_client_cancels_during_a_forward_pass(d_async: bool) -> None:
    """A cancel during a forward pass freed blocks the step was writing. Here the
    request keeps them until the step completes; its sampled token is dropped."""
    pair = Pair(d_async=d_async)
    kv = pair.prefill("r")
    pair.submit("r", kv)
    pair.step_d()
    pair.deliver_to_p()
    pair.deliver_to_d()
    pair.transport.land(pair.transport.handles[0])
    pair.transport.finish(pair.transport.handles[0])
    pair.tick()
    pair.deliver_to_p()
    pair.deliver_to_d()
    batch = pair.d.schedule()  # the forward pass begins
    assert batch is not None
    pair.rx.abort("r", pair.now)
    req = pair.d.requests["r"]
    assert req.state is RequestState.FINISHING and pair.d_pool.owned_count(req.owner) == 3
    pair.d.complete(batch, pair.d.runner.execute(batch))
    assert pair.d.stats.dropped_samples == 1
    assert pair.finished == {} and pair.d.take_outputs()[0].finish_reason is FinishReason.ABORT
    pair.assert_all_free()


class StallingRelay:
    """A prefill stand-in that answers READ, sends half the bytes and stalls."""

    def __init__(self, nbytes: int) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.nbytes = nbytes
        self.conns: list[socket.socket] = []
        self.stalled = threading.Event()  # READ answered and half the bytes sent
        self.error: BaseException | None = None
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
            self.conns.append(conn)
            msg = P.recv_frame(conn)
            assert isinstance(msg, P.Read)
            conn.sendall(P.encode(P.Reply(msg.seq, "ok", nbytes=self.nbytes)))
            conn.sendall(b"\x01" * (self.nbytes // 2))
            self.stalled.set()
        except BaseException as e:  # reported by the test, not lost in this thread
            self.error = e


def test_race11_abort_while_the_peer_writes_into_our_blocks() -> None:
    """Push-style: the peer wrote into D's blocks after D had freed them. With the
    tcp transport the socket writes into D's cache; an abort drains until the
    reader thread has stopped, and only then frees the blocks."""
    kv = torch.zeros(kv_shape(TINY_GEOMETRY, NBLOCKS))
    pool = BlockPool(NBLOCKS)
    engine = Engine(SchedulerConfig(num_blocks=NBLOCKS, block_size=4),
                    TensorFakeRunner(kv, pool=pool, vocab_size=VOCAB), pool=pool)
    relay = StallingRelay(3 * TINY_GEOMETRY.block_bytes)
    tr = TcpTransport(kv, connect=lambda addr: socket.create_connection(
        ("127.0.0.1", int(addr.split(":")[1]))))
    sent: list[P.Request] = []

    class Link:
        def send(self, relay: str, msg: P.Request) -> None:
            sent.append(msg)

        def peer(self, r: str) -> PeerInfo:
            return PeerInfo(r, "p1")

        def trusted(self, r: str) -> bool:
            return True

    rx = Receiver(EngineKvLoads(engine), Link(), tr, holder="d1", compat="c",
                  config=ReceiverConfig())
    remote = RemoteKv("L", relay.address, "p1", [0, 1, 2], 9, 5, "c")
    rx.submit("r", list(range(9)), SamplingParams(max_tokens=4, seed=1), remote, 0.0)
    engine.step()
    rx.tick(0.0)
    rx.on_reply(P.Reply(sent[0].seq, "ok", block_ids=[0, 1, 2], generations=[0, 0, 0],
                        num_tokens=9, first_token=5,
                        prompt_digest=P.prompt_digest(list(range(9)))), 0.0)
    load = rx.loads["r"]
    # abort only once the peer is writing into D's blocks (not before it got the READ)
    assert relay.stalled.wait(10), relay.error
    deadline = time.monotonic() + 10
    rx.abort("r", 0.0)
    assert engine.requests["r"].state is RequestState.DRAINING
    assert pool.num_free == NBLOCKS - 3
    while load.phase is Phase.DRAINING and time.monotonic() < deadline:
        rx.tick(0.0)
        time.sleep(0.002)
    assert tr.poll(load.handle).state is TransferState.FAILED  # the reader stopped
    assert "r" not in engine.requests and pool.num_free == NBLOCKS
    assert type(sent[-1]) is P.Abort


@pytest.mark.parametrize("policy", [Policy.RECOMPUTE, Policy.FAIL])
def test_race12_prefill_crashed_decode_does_not_wait_forever(policy: Policy) -> None:
    """P died: D waited for its KV forever. Here D gives up at peer_timeout, after
    retransmitting, and recomputes or fails with a clear error."""
    pair = Pair(policy=policy)
    kv = pair.prefill("r")
    pair.submit("r", kv)
    pair.step_d()
    for t in range(1, 12):  # P answers nothing: every message is lost
        pair.now = float(t)
        pair.outbox.clear()
        pair.step_d()
    assert pair.rx.stats.fallbacks == {"unreachable": 1}
    if policy is Policy.FAIL:
        out = pair.finished["r"]
        assert out.finish_reason is FinishReason.ERROR and "did not answer" in out.error
    else:
        for _ in range(10):
            pair.step_d()
        assert decoded(pair, "r", kv) == pair.expect(1)
    assert pair.d_pool.num_free == NBLOCKS and not pair.rx.loads


def test_restarted_prefill_rejects_its_previous_life_and_decode_recomputes() -> None:
    pair = Pair()
    kv = pair.prefill("r")
    pair.table.engine_id = "p2"  # P restarted: a new engine id
    pair.submit("r", kv)
    pair.converse()
    assert pair.rx.stats.fallbacks == {"engine_restarted": 1}
    assert decoded(pair, "r", kv) == pair.expect(1)


def test_duplicated_and_reordered_messages_release_once() -> None:
    pair = Pair()
    kv = pair.prefill("r")
    pair.submit("r", kv)
    pair.step_d()
    acquire = pair.outbox[0]
    pair.outbox.append(acquire)  # duplicated ACQUIRE
    pair.deliver_to_p()
    pair.deliver_to_d()
    assert pair.rx.stats.stale_replies == 1
    pair.converse()
    release = P.Release(99, "p1", kv.lease_id, "d1", "a1", True)
    late = [P.Heartbeat(98, "p1", kv.lease_id, "d1", "a1"), release,
            P.Abort(97, "p1", kv.lease_id, "d1", "a1")]
    for msg in late:  # late duplicates after the release: the verdict does not change
        assert pair.relay.handle(msg, pair.now).reason == "done"
    assert pair.table.stats.released == {"done": 1}
    assert decoded(pair, "r", kv) == pair.expect(1)
    pair.assert_all_free()


def test_abort_overtakes_acquire() -> None:
    pair = Pair()
    kv = pair.prefill("r")
    pair.submit("r", kv)
    pair.step_d()
    pair.rx.abort("r", pair.now)
    pair.outbox.reverse()  # ABORT reaches P before ACQUIRE
    replies = pair.deliver_to_p()
    assert [r.status for r in replies] == ["ok", "released"]
    pair.deliver_to_d()
    assert pair.table.stats.released == {"aborted": 1}
    pair.assert_all_free()


def test_dropped_release_is_retransmitted_and_committed_once() -> None:
    pair = Pair()
    kv = pair.prefill("r")
    pair.submit("r", kv)
    pair.step_d()
    pair.deliver_to_p()
    pair.deliver_to_d()
    pair.transport.land(pair.transport.handles[0])
    pair.transport.finish(pair.transport.handles[0])
    pair.tick()
    first = pair.outbox.pop()  # RELEASE(ok) lost
    assert isinstance(first, P.Release)
    pair.now = 1.5
    pair.tick()
    (again,) = pair.outbox
    assert again == first  # the same message, same seq
    pair.converse()
    assert pair.table.stats.released == {"done": 1} and pair.rx.stats.loaded == 1
    pair.assert_all_free()


def test_decode_crash_leaves_prefill_free_after_the_deadline() -> None:
    pair = Pair(acquire=1.0)
    kv = pair.prefill("r")
    pair.submit("r", kv)
    pair.step_d()
    pair.deliver_to_p()  # ACQUIRE: PULLING; then D dies without a word
    assert pair.table.leases[kv.lease_id].state is LeaseState.PULLING
    pair.now = 1.0
    pair.table.expire(pair.now)
    assert pair.table.stats.released == {"expired": 1}
    assert pair.p_pool.num_free == NBLOCKS
    late = pair.table.release("p1", kv.lease_id, "d1", "a1", True, 2.0)
    assert late.reason is ReleaseReason.EXPIRED and not late.ok


def test_the_sim_runner_catches_decoding_foreign_kv() -> None:
    """The check the fence tests rely on really fires."""
    pair = Pair()
    kv = pair.prefill("r")
    pair.submit("r", kv)
    pair.step_d()
    pair.d.kv_load_start("r")
    pair.d.kv_load_done("r")  # the naive design: no copy, no validation
    with pytest.raises(Violation, match="bad KV"):
        pair.d.step()


def test_first_token_completes_the_request_and_the_lease_is_released() -> None:
    """The prefill side hands over even when max_tokens is 1 (the proxy asks it for one
    token): D must finish at once and still release the lease, not wait for KV."""
    pair = Pair()
    kv = pair.prefill("r", max_tokens=2)
    pair.submit("r", kv, max_tokens=1)
    assert [type(m) for m in pair.outbox] == [P.Release]
    pair.converse()
    assert pair.table.stats.released == {"done": 1}
    assert decoded(pair, "r", kv) == pair.expect(1, max_tokens=1)
    pair.assert_all_free()
