"""``kv_connector_extra_config``: kvrelay's relay settings, named as ``kvrelay serve``'s
flags (docs/vllm.md lists them)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

from kvrelay import env

if TYPE_CHECKING:
    from kvrelay.relay.sides import SideSettings

T = TypeVar("T")

TRANSPORTS = ("tcp", "nixl", "cuda_ipc")
STAGING_MIB_MAX = 1 << 16


@dataclass(frozen=True)
class ConnectorSettings:
    relay_host: str = "127.0.0.1"  # prefill: the address the relay port binds
    # prefill: the first worker's port; worker k of the engine (tensor and pipeline
    # rank, data-parallel index) takes relay_port + k. 0 = any free port (logged, and
    # named in the params).
    relay_port: int = 0
    # prefill: the host decode engines are told to dial; empty: relay_host, or, where
    # that is a wildcard (0.0.0.0, ::), vLLM's VLLM_HOST_IP.
    relay_advertise_host: str = ""
    relay_secret: str | None = None  # HMAC of HELLO; env KVRELAY_RELAY_SECRET
    kv_transport: str = "tcp"
    lease_timeout: float = 30.0  # an un-acquired (or un-heartbeated) lease is freed after
    lease_max: float = 480.0  # hard cap on a lease's life
    # vLLM steps empty while a lease is held or D waits for KV (~440 steps/s): an empty
    # step waits up to this long in the worker unless a report is ready. 0: no wait.
    idle_step_ms: float = 20.0
    # D: pull from a relay on another host with no relay_secret proving it. vLLM caches
    # every committed load for all requests, and the params name any relay a client
    # likes: off, such a pull is refused (the request is prefilled on D).
    trust_unauthenticated_relays: bool = False
    # The CPUs the relay's threads run on ("0-3,8"); empty: the CPUs this engine was
    # given (its parent process's affinity: vLLM binds its CPU worker's own threads).
    relay_cpus: str = ""
    # Page-locked host memory per worker (rank) for tcp with a KV cache on a GPU: the
    # blocks are staged through pairs of buffers (transports/staging.py).
    staging_mib: int = 64

    def __post_init__(self) -> None:
        if self.kv_transport not in TRANSPORTS:
            raise ValueError(f"kv_connector_extra_config.kv_transport {self.kv_transport!r} "
                             f"is not supported by the vLLM connector; allowed: "
                             f"{', '.join(TRANSPORTS)}")
        if not 0 <= self.relay_port < 65536:
            raise ValueError(f"kv_connector_extra_config.relay_port must be 0..65535, got "
                             f"{self.relay_port}")
        if not 0 <= self.idle_step_ms <= 1000:
            raise ValueError("kv_connector_extra_config.idle_step_ms must be 0..1000, got "
                             f"{self.idle_step_ms}")
        parse_cpus(self.relay_cpus)
        if not 1 <= self.staging_mib <= STAGING_MIB_MAX:
            raise ValueError("kv_connector_extra_config.staging_mib must be "
                             f"1..{STAGING_MIB_MAX} (MiB of page-locked host memory per "
                             "worker for tcp with a KV cache on a GPU), got "
                             f"{self.staging_mib}")
        if not 0 < self.lease_timeout <= self.lease_max:
            raise ValueError("kv_connector_extra_config: need 0 < lease_timeout "
                             f"({self.lease_timeout}) <= lease_max ({self.lease_max})")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """Parse ``kv_connector_extra_config``; an unknown key or a wrong type is an
        error naming the key and what is allowed."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown key(s) {unknown}; "
                             f"allowed: {sorted(known)}")
        kw: dict[str, Any] = {}
        for key, value in extra.items():
            kw[key] = _typed(key, value, type(getattr(cls, key, "")))
        if "relay_secret" not in kw and (secret := env.get("KVRELAY_RELAY_SECRET")):
            kw["relay_secret"] = secret
        return cls(**kw)

    @property
    def secret(self) -> bytes | None:
        return self.relay_secret.encode() if self.relay_secret else None

    def advertised_host(self) -> str:
        """The host in the params P hands out: ``relay_advertise_host``, else
        ``relay_host`` unless it is a wildcard, else vLLM's ``VLLM_HOST_IP``. A wildcard
        with neither is an error naming both keys (D cannot dial 0.0.0.0)."""
        for key, host in (("relay_advertise_host", self.relay_advertise_host),
                          ("relay_host", "" if self.relay_host in WILDCARDS else
                           self.relay_host),
                          ("VLLM_HOST_IP", os.environ.get("VLLM_HOST_IP", "").strip())):
            if host:
                return _canonical_host(key, host)
        raise ValueError(
            f"kv_connector_extra_config.relay_host {self.relay_host!r} binds every "
            "address, which decode engines cannot dial: set relay_advertise_host (or "
            "VLLM_HOST_IP) to the address they reach this engine at")

    def sides(self, worker: int = 0, *, serve: bool = False) -> SideSettings:
        """What kvrelay.relay.sides builds both sides from. ``serve`` (P): the relay
        port of ``worker``, this worker's index among the engine's workers (tensor and
        pipeline rank, data-parallel index), which a fixed ``relay_port`` is offset by,
        and the host advertised."""
        from kvrelay.relay.sides import SideSettings

        port = self.relay_port + worker if self.relay_port and serve else self.relay_port
        if port > 65535:
            raise ValueError(
                f"kv_connector_extra_config.relay_port {self.relay_port}: worker {worker} "
                f"of this engine would listen on {port}, past 65535 (each worker takes "
                "relay_port + its index)")
        return SideSettings(kv_transport=self.kv_transport, lease_timeout=self.lease_timeout,
                            lease_max=self.lease_max, secret=self.secret,
                            relay_host=self.relay_host, relay_port=port,
                            relay_advertise_host=self.advertised_host() if serve else "")


WILDCARDS = ("0.0.0.0", "::", "")


def _canonical_host(key: str, host: str) -> str:
    """``host`` as D spells it after canonical_relay (an IP address in standard form, a
    lower-case name): P's HELLO proof is bound to the address it advertises, and D
    checks it against the one it dialled."""
    from kvrelay.relay.remote import canonical_relay

    try:
        return canonical_relay(f"{host}:1").rpartition(":")[0]
    except ValueError as e:
        raise ValueError(f"kv_connector_extra_config.{key} {host!r}: an IP address or a "
                         f"host name ({e})") from None


def _typed(key: str, value: Any, want: type) -> Any:
    if key == "relay_secret":
        if value is not None and not isinstance(value, str):
            raise ValueError("kv_connector_extra_config.relay_secret must be a string")
        return value
    if want is bool and isinstance(value, bool):
        return value
    if want is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if want is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if want is str and isinstance(value, str):
        return value
    raise ValueError(f"kv_connector_extra_config.{key} must be {want.__name__}, got {value!r}")


def parse_cpus(spec: str) -> set[int]:
    """``relay_cpus`` ("0-3,8") as a set; empty for ""."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or int(hi or lo) < int(lo):
            raise ValueError(f"kv_connector_extra_config.relay_cpus {spec!r}: allowed: CPU "
                             "numbers and ranges, e.g. '0-3,8'")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def relay_cpus(settings: ConnectorSettings) -> set[int]:
    """Where the relay's threads run: ``relay_cpus``, else the CPUs this engine was
    given. vLLM's CPU worker binds the thread that builds the connector (and OpenMP's)
    to the cores it computes on, and a relay thread queued behind a forward pass made a
    HELLO take seconds; the engine's parent process (EngineCore) still runs on what the
    operator gave the engine (taskset, numactl, cgroup)."""
    if settings.relay_cpus:
        return parse_cpus(settings.relay_cpus)
    mine = os.sched_getaffinity(0)
    with contextlib.suppress(OSError):
        parent = os.sched_getaffinity(os.getppid())
        if mine < parent:
            return parent
    return mine


def run_on_relay_cpus(settings: ConnectorSettings, fn: Callable[[], T]) -> T:
    """``fn()`` on a fresh thread bound to ``relay_cpus(settings)``, so the threads it
    starts (the relay's) run there too."""
    out: list[T] = []
    errors: list[BaseException] = []
    cpus = relay_cpus(settings)

    def body() -> None:
        try:
            with contextlib.suppress(AttributeError):
                os.sched_setaffinity(0, cpus)
            out.append(fn())
        except BaseException as e:  # re-raised in the caller
            errors.append(e)

    t = threading.Thread(target=body, name="kvrelay-start")
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return out[0]
