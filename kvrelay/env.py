"""The KVRELAY_* environment knobs the package reads: one registry (name, type, default,
what it changes) and readers that parse a knob when called. docs/environment.md lists
them with the build and test knobs. Imports nothing from kvrelay but its usage error,
and not torch."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from kvrelay.errors import UsageError

KnobType = Literal["str", "int", "float", "bool", "choice"]
_DEFAULT: Any = object()  # get(): the knob's own default


class BadKnob(UsageError, ValueError):
    """A knob's value does not parse: one line naming the variable and what is allowed
    (the command exits 2, as for a bad flag)."""


@dataclass(frozen=True)
class Knob:
    """One variable. Unset or empty, it reads as ``default``; a ``bool`` is ``0`` or ``1``;
    a ``choice`` is one of ``choices``, any case (read lower-cased)."""

    name: str
    type: KnobType
    default: Any
    doc: str
    choices: tuple[str, ...] = ()

    def parse(self, raw: str) -> Any:
        """``raw`` as this knob's type; ``BadKnob`` (a ValueError) naming the variable, the
        value and what is allowed when it does not parse."""
        try:
            if self.type == "bool" and raw in ("0", "1"):
                return raw == "1"
            if self.type == "choice" and raw.lower() in self.choices:
                return raw.lower()
            if self.type == "int":
                return int(raw)
            if self.type == "float":
                return float(raw)
            if self.type == "str":
                return raw
        except ValueError:
            pass
        allowed = {"bool": "0 or 1", "int": "an integer", "float": "a number",
                   "choice": "one of " + ", ".join(self.choices)}[self.type]
        raise BadKnob(f"{self.name}={raw!r}: allowed: {allowed} (or unset)")


KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("KVRELAY_ALLOW_SLOW_BF16", "bool", False,
         "1: serve --dtype bfloat16 on a CPU without native bfloat16 (about 3x slower than "
         "float32) instead of refusing it"),
    Knob("KVRELAY_AMX_GEMM", "bool", True,
         "0: bfloat16 GEMMs skip the native AMX kernel (oneDNN takes the larger ones)"),
    Knob("KVRELAY_API_KEY", "str", None,
         "default of serve's --api-key: require 'Authorization: Bearer KEY' on /v1"),
    Knob("KVRELAY_FAULT_ANSWER_DELAY_S", "float", 0.0,
         "fault injection for tests: a prefill engine waits this many seconds between "
         "making a lease and writing its answer"),
    Knob("KVRELAY_FAULT_TRANSFER_DELAY_S", "float", 0.0,
         "fault injection for tests: every KV transfer waits this many seconds "
         "(cancellable) before it starts writing"),
    Knob("KVRELAY_FAULT_VLLM_HOLD_DELAY_S", "float", 0.0,
         "fault injection for tests: the vLLM connector's prefill worker waits this many "
         "seconds before it makes a step's leases"),
    Knob("KVRELAY_FAULT_VLLM_RAISE", "str", None,
         "fault injection for tests: POINT[:N],... makes the N-th unit of work (all, "
         "without N) at a point of the vLLM connector raise (hold, submit, reply; "
         "kvrelay/vllm/faults.py)"),
    Knob("KVRELAY_HUGEPAGES", "bool", True,
         "0: kvrelay stops asking for 2 MiB pages under the packed decode weights and the "
         "KV cache"),
    Knob("KVRELAY_KERNELS", "choice", "auto",
         "layer kernels, the default of kvrelay --kernels: native C++ where built and "
         "supported, else torch (native: and a warning), torch", ("auto", "native", "torch")),
    Knob("KVRELAY_KV_POPULATE", "bool", True,
         "0: the KV cache is committed as requests first write it, not at start (Linux)"),
    Knob("KVRELAY_NATIVE_GEMM", "bool", True,
         "0: decode-sized GEMMs skip the native kernels (and so the AMX one): oneDNN"),
    Knob("KVRELAY_NATIVE_ISA", "choice", None,
         "avx2: the native kernels run their AVX2 path on an AVX-512 CPU (unset: the widest "
         "the CPU runs); read by the C++ extension when it loads (other values: ignored)",
         ("avx2",)),
    Knob("KVRELAY_NIXL_PROGRESS_DELAY_US", "int", 200,
         "microseconds the progress thread of kvrelay's NIXL agent sleeps when idle"),
    Knob("KVRELAY_OMP_WAIT_POLICY", "choice", "passive",
         "OpenMP wait policy, the default of kvrelay --omp-wait-policy; read when kvrelay "
         "is imported, before torch (a bad value: a warning, then passive); an "
         "OMP_WAIT_POLICY in the environment wins", ("active", "passive", "auto")),
    Knob("KVRELAY_PREFILL_AMX", "bool", True,
         "with KVRELAY_PREFILL_SDPA=1, 0: prompt chunks never attend through kvrelay's AMX "
         "kernel"),
    Knob("KVRELAY_PREFILL_SDPA", "bool", None,
         "1: every prompt chunk attends through torch's SDPA (or kvrelay's AMX kernel), "
         "faster on long prompts but a prompt's answer then depends on how it was "
         "chunked or cached; unset or 0: the native tiles"),
    Knob("KVRELAY_RELAY_SECRET", "str", None,
         "shared secret authenticating decode engines (HMAC of HELLO): the default of "
         "serve's --relay-secret and of the vLLM connector's relay_secret"),
)}


def get(name: str, default: Any = _DEFAULT) -> Any:
    """The knob ``name`` parsed from the environment now; unset or empty: ``default``
    (the knob's own unless given). A KeyError for a name not in KNOBS."""
    knob = KNOBS[name]
    raw = os.environ.get(name)
    if not raw:
        return knob.default if default is _DEFAULT else default
    return knob.parse(raw)


def set_but_empty(name: str) -> bool:
    """Is ``name`` in the environment with an empty value (read as unset by ``get``)?"""
    KNOBS[name]  # a KeyError for a name not in KNOBS
    return os.environ.get(name) == ""


def setenv(name: str, value: str) -> None:
    """Set the knob for this process and its children (checked as get() would read it)."""
    KNOBS[name].parse(value)
    os.environ[name] = value


@contextlib.contextmanager
def overridden(name: str, value: str | None) -> Iterator[None]:
    """The knob set to ``value`` inside the block (None: left as it is), then restored."""
    if value is None:
        yield
        return
    KNOBS[name].parse(value)
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous
