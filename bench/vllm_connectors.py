"""vLLM 1P1D with KvRelayConnector (tcp and nixl) against vLLM 1P1D with NixlConnector and
colocated vLLM, one run (docs/vllm.md, "Benchmark"): TTFT, TPOT, the decode leg and the
transfer time per request, greedy texts checked against colocated vLLM's; then the
reused-block scenario through every connector side by side.

    PYTHONPATH=. KVRELAY_VLLM_VENV=/tmp/kvrelay-vllm/v-vllm .venv/bin/python \\
        bench/vllm_connectors.py [--requests 8] [--legs kvrelay-tcp,kvrelay-nixl,nixl]
        [--no-reused-blocks] [--json out.json]                       # make bench-vllm

Every request goes P then D the way vLLM's toy proxy drives both connectors (P: the
prompt with max_tokens 1 and ``do_remote_decode``; D: the prompt with P's
``kv_transfer_params``, streamed; D's text is the answer), so every leg is measured
by the same client. TTFT: from sending P the request to D's first token. Decode leg:
from sending D the request to its first token (its pull, plus one forward pass). TPOT:
D's token gaps after the first. Transfer: what each connector reports in D's log
(KvRelayConnector: ACQUIRE answered to commit confirmed, per request, and by phase, its
READ alone among them; NixlConnector: vLLM's "KV Transfer metrics" average xfer time,
READ posted to seen done). Each pair serves one P/D request before the measured ones
(its first pull connects: NIXL loads P's metadata and wires UCX up); its transfer is
printed apart.

The reused-block scenario (on unless ``--no-reused-blocks``): D stopped (SIGSTOP) after
P answered and before D got the request, past P's lease (KvRelayConnector
lease_timeout 8 s; NixlConnector kv_lease_duration 8 s); P's blocks get other requests'
KV meanwhile; D resumes and decodes. Prompts differ per request (no prefix-cache hit on
P). Engines: SmolLM2-135M fp32, a KV cache of 150 MB; one core each, every thread
(``taskset -a`` once healthy, see ``pin``): P and the colocated engine on core 0, D on
core 1. The colocated engine runs alone first, then one pair at a time. The ``-tp2``
legs: P and D at --tensor-parallel-size 2 (a worker per core, 4 workers on the 2 cores,
not pinned further) on a tiny Llama with 4 KV heads, against colocated vLLM at TP 2 on
that model, which runs before them.
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.vllm.pair import MODEL, PYTHON, VllmEngine, missing

MAX_TOKENS = 32
CORES = 2  # P (and the colocated engine) on core 0, D on core 1
LEGS = ("kvrelay-tcp", "kvrelay-nixl", "nixl", "kvrelay-tcp-tp2", "nixl-tp2")
# The tensor-parallel legs: P and D at --tensor-parallel-size 2 (a worker per core, not
# pinned further) on a tiny Llama with 4 KV heads (SmolLM2's 3 do not split in two),
# against colocated vLLM at TP 2 on the same model.
# (its byte-level tokenizer of 384 tokens spends about 4 tokens a word: a longer context)
TP_ARGS = ["--tensor-parallel-size", "2", "--max-model-len", "4096"]
TP_BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
LEASE_S = 8
NIXL_FIRST = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}
KVRELAY_FIRST = {"do_remote_decode": True}
# What P logs when a lease ran out unpulled, per connector.
EXPIRED = {"kvrelay": r"kvrelay: lease \S+ of request \S+ ended \(expired\)",
           "nixl": r"Releasing expired KV blocks for request"}


def prompt(i: int, words: int) -> str:
    return f"{secrets.token_hex(4)} request {i}: " + "the tide rolls over the stones " * (
        words // 6) + "and then"


def stream(url: str, text: str, params: dict[str, Any] | None) -> tuple[float, list[float], str]:
    """(time the request was sent, arrival time of each token, the text)."""
    body: dict[str, Any] = {"model": "smol", "prompt": text, "max_tokens": MAX_TOKENS,
                            "temperature": 0, "stream": True}
    if params is not None:
        body["kv_transfer_params"] = params
    t0, stamps, out = time.perf_counter(), [], []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
                out.append(chunk["choices"][0]["text"])
    return t0, stamps, "".join(out)


def first_leg(p: VllmEngine, text: str, first: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{p.url}/v1/completions", timeout=300, json={
        "model": "smol", "prompt": text, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": first})
    r.raise_for_status()
    params = r.json().get("kv_transfer_params")
    if not params:
        raise RuntimeError(f"{p.name} returned no kv_transfer_params: {r.text[:300]}")
    return dict(params)


def measure(texts: list[str], want: list[str] | None, ask: Any) -> dict[str, Any]:
    ttft, leg, tpot, wrong = [], [], [], 0
    for i, text in enumerate(texts):
        t_start, t_leg, stamps, out = ask(text)
        ttft.append(1000 * (stamps[0] - t_start))
        leg.append(1000 * (stamps[0] - t_leg))
        if len(stamps) > 1:
            tpot.append(1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1))
        if want is not None and out != want[i]:
            wrong += 1
    return {"ttft_ms": statistics.median(ttft), "decode_leg_ms": statistics.median(leg),
            "tpot_ms": statistics.median(tpot), "wrong_texts": wrong, "n": len(texts)}


def colocated_ask(colo: VllmEngine) -> Any:
    def ask(text: str) -> tuple[float, float, list[float], str]:
        t0, stamps, out = stream(colo.url, text, None)
        return t0, t0, stamps, out
    return ask


def pd_ask(p: VllmEngine, d: VllmEngine, first: dict[str, Any]) -> Any:
    def ask(text: str) -> tuple[float, float, list[float], str]:
        t0 = time.perf_counter()
        params = first_leg(p, text, first)
        t1, stamps, out = stream(d.url, text, params)
        return t0, t1, stamps, out
    return ask


PHASES = ("acquire", "read", "own", "first_byte", "bytes", "noticed", "commit", "reported")


def transfer_ms(d: VllmEngine, connector: str, skip: int
                ) -> tuple[float | None, int, dict[str, float]]:
    """(mean transfer ms, transfers, mean ms by phase) from D's log past its first
    ``skip`` characters. KvRelayConnector: its full span (ACQUIRE answered to the
    commit confirmed) and its phases (``read``: the READ alone, the span comparable to
    NixlConnector's); NixlConnector: its xfer time, READ posted to seen done."""
    log = d.log.read_text(errors="replace")[skip:]
    if connector == "kvrelay":
        lines = re.findall(r"loaded in ([\d.]+) ms \(copy and commit; ([^;]*); reported to "
                           r"vLLM ([\d.]+) ms later\)", log)
        by: dict[str, list[float]] = {}
        for total, phases, reported in lines:
            by.setdefault("load", []).append(float(total))
            by.setdefault("reported", []).append(float(reported))
            for name, v in re.findall(r"(\w+) ([\d.]+)", phases):
                by.setdefault(name, []).append(float(v))
        means = {k: statistics.mean(v) for k, v in by.items()}
        return means.get("load"), len(lines), means
    total, n = 0.0, 0
    for m in re.finditer(r"KV Transfer metrics: Num successful transfers=(\d+), "
                         r"Avg xfer time \(ms\)=([\d.]+)", log):
        k = int(m.group(1))
        total, n = total + k * float(m.group(2)), n + k
    return (total / n if n else None), n, ({"read": total / n} if n else {})


def fill(p: VllmEngine) -> None:
    """Long requests on P, through every block of its small cache."""
    for i in range(5):
        httpx.post(f"{p.url}/v1/completions", timeout=300, json={
            "model": "smol", "prompt": f"{i} " + "the gulls cry over the harbour " * 120,
            "max_tokens": 1}).raise_for_status()


def reused_block_scenario(p: VllmEngine, d: VllmEngine, first: dict[str, Any],
                          text: str, want: str, expired: str) -> dict[str, Any]:
    params = first_leg(p, text, first)
    seen = p.count(expired)
    d.signal_all(signal.SIGSTOP)
    out: dict[str, Any] = {}

    def decode() -> None:
        try:
            out["text"] = stream(d.url, text, params)[2]
        except Exception as e:  # reported as the outcome
            out["error"] = repr(e)

    t = threading.Thread(target=decode)
    try:
        t.start()  # the request waits in D's socket backlog while D is stopped
        p.wait_log(expired, seen + 1, timeout=6 * LEASE_S)
        fill(p)
    finally:
        d.signal_all(signal.SIGCONT)
    t.join(300)
    return {"params_keys": sorted(params), "want": want, **out}


def pin(engine: VllmEngine, core: int) -> None:
    """Every thread of ``engine`` (API server, EngineCore, worker and the threads they
    started) onto ``core``: vLLM's own binding is overridden by NixlConnector's worker,
    which moves its forward-pass thread to the last core of each NUMA node (here core 1
    for both engines), so the placement is set from outside, the same for every leg."""
    assert engine.proc is not None
    pids = subprocess.run(["pgrep", "-g", str(engine.proc.pid)], capture_output=True,
                          text=True, check=False).stdout.split()
    for pid in pids:
        subprocess.run(["taskset", "-a", "-p", "-c", str(core), pid], capture_output=True,
                       check=False)  # a process that just exited is no error


def start(engines: list[VllmEngine], pin_cores: bool = True) -> None:
    for e in engines:
        e.start()
    for e in engines:
        e.wait_healthy()
    for core, e in enumerate(engines):
        if pin_cores:
            pin(e, core % CORES)
    for e in engines:  # a cold engine's first request takes seconds
        httpx.post(f"{e.url}/v1/completions", timeout=300, json={
            "model": "smol", "prompt": "warm up", "max_tokens": 2}).raise_for_status()


def stop(engines: list[VllmEngine]) -> None:
    for e in engines:
        e.kill()


def pair_leg(key: str, p: VllmEngine, d: VllmEngine, first: dict[str, Any],
             connector: str, expired: str, texts: list[str], want: list[str],
             scen: tuple[str, str] | None, results: dict[str, Any]) -> None:
    """One 1P1D leg: the requests, D's transfer times, then the reused-block scenario
    (``scen``: its prompt and colocated text). A leg that fails says why in the results;
    both engines are stopped either way."""
    try:
        start([p, d], pin_cores=not key.endswith("-tp2"))
        # One P/D request first, its transfer not counted (every connector's first pull
        # to a new P also connects: NIXL loads P's metadata and wires UCX up).
        pd_ask(p, d, first)(prompt(-1, len(texts[0].split())))
        if connector == "nixl":
            time.sleep(11)  # its metrics line (every 10 s) must come before ``skip``
        cold = transfer_ms(d, connector, 0)[0]
        skip = len(d.log.read_text(errors="replace"))
        results[key] = measure(texts, want, pd_ask(p, d, first))
        results[key]["first_pull_ms"] = cold
        if connector == "nixl":
            time.sleep(11)  # vLLM logs NixlConnector's transfer metrics every 10 s
        (results[key]["transfer_ms"], results[key]["transfers"],
         results[key]["phases_ms"]) = transfer_ms(d, connector, skip)
        if scen is not None:
            results[key + "_reused"] = reused_block_scenario(p, d, first, *scen, expired)
    except Exception as e:  # the leg that cannot run says why, the rest is printed
        results[key + "_error"] = f"{type(e).__name__}: {e}\n{d.tail(3000)}"
    finally:
        stop([p, d])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--words", type=int, default=360, help="prompt length (~1.2 tokens a word)")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    ap.add_argument("--legs", default=",".join(LEGS),
                    help=f"1P1D legs to run, of {','.join(LEGS)} (colocated always runs)")
    ap.add_argument("--no-reused-blocks", dest="reused_blocks", action="store_false",
                    help="skip the reused-block scenario at the end of each leg")
    args = ap.parse_args(argv)
    legs = args.legs.split(",") if args.legs else []
    if missing() or set(legs) - set(LEGS):
        print(f"bench-vllm: {missing() or f'--legs: {args.legs!r}, allowed: {LEGS}'}",
              file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="kvrelay-bench-vllm-"))
    print(f"vLLM venv {PYTHON.parent.parent}, model {MODEL}, logs in {tmp}", flush=True)
    texts = [prompt(i, args.words) for i in range(args.requests)]
    scen_text = prompt(999, 200)
    results: dict[str, Any] = {}
    # VLLM_CPU_OMP_THREADS_BIND too: vLLM's own placement matches pin()'s from the start.
    bind = [{"VLLM_CPU_OMP_THREADS_BIND": str(c % CORES)} for c in range(2)]

    want: list[str] = []
    scen: tuple[str, str] | None = None
    if any(not leg.endswith("-tp2") for leg in legs) or not legs:
        colo = VllmEngine("colocated", "none", tmp / "colo.log", kv_config={}, env=bind[0])
        try:  # alone: the pairs start after it stopped (memory: ~3.5 GB an engine)
            start([colo])
            want = [stream(colo.url, t, None)[2] for t in texts]  # the reference texts
            results["colocated"] = measure(texts, want, colocated_ask(colo))
            scen_want = stream(colo.url, scen_text, None)[2]
        finally:
            stop([colo])
        scen = (scen_text, scen_want) if args.reused_blocks else None
    tp_model, want_tp, scen_tp = None, want, scen
    if any(leg.endswith("-tp2") for leg in legs):
        from tests.vllm.test_vllm_tp import write_model

        tp_model = write_model(tmp / "tiny4", max_len=4096)
        colo = VllmEngine("colocated-tp2", "none", tmp / "colo-tp2.log", kv_config={},
                          env=TP_BIND, args=TP_ARGS, model=tp_model)
        try:
            start([colo], pin_cores=False)
            want_tp = [stream(colo.url, t, None)[2] for t in texts]
            results["colocated-tp2"] = measure(texts, want_tp, colocated_ask(colo))
            scen_tp = ((scen_text, stream(colo.url, scen_text, None)[2])
                       if args.reused_blocks else None)
        finally:
            stop([colo])

    for leg in legs:
        tp = leg.endswith("-tp2")
        kw: dict[str, Any] = {"args": TP_ARGS, "model": tp_model} if tp else {}
        envs = [TP_BIND, TP_BIND] if tp else bind
        leg_want, leg_scen = (want_tp, scen_tp) if tp else (want, scen)
        if leg.startswith("kvrelay"):
            extra = {"lease_timeout": LEASE_S, "lease_max": 60,
                     "kv_transport": leg.split("-")[1]}
            p = VllmEngine(f"{leg}-P", "kv_producer", tmp / f"{leg}-p.log", extra,
                           env=envs[0], **kw)
            d = VllmEngine(f"{leg}-D", "kv_consumer", tmp / f"{leg}-d.log", extra,
                           env=envs[1], **kw)
            pair_leg(leg, p, d, KVRELAY_FIRST, "kvrelay", EXPIRED["kvrelay"], texts,
                     leg_want, leg_scen, results)
            continue
        nixl_cfg = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                    "kv_buffer_device": "cpu",
                    "kv_connector_extra_config": {"kv_lease_duration": LEASE_S}}
        p, d = (VllmEngine(f"{leg}-{r}", "kv_both", tmp / f"{leg}-{r.lower()}.log",
                           kv_config=nixl_cfg,
                           env={**envs[i], "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_port()),
                                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}, **kw)
                for i, r in enumerate("PD"))
        pair_leg(leg, p, d, NIXL_FIRST, "nixl", EXPIRED["nixl"], texts, leg_want, leg_scen,
                 results)
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def _port() -> int:
    from kvrelay.demo import free_port

    return free_port()


NAMES = {"colocated": "colocated vLLM", "kvrelay-tcp": "1P1D KvRelayConnector tcp",
         "kvrelay-nixl": "1P1D KvRelayConnector nixl", "nixl": "1P1D NixlConnector",
         "colocated-tp2": "colocated vLLM TP 2", "kvrelay-tcp-tp2": "1P1D KvRelay tcp TP 2",
         "nixl-tp2": "1P1D NixlConnector TP 2"}


def report(r: dict[str, Any]) -> None:
    print(f"\n{'':28}{'TTFT ms':>10}{'decode leg ms':>15}{'TPOT ms':>10}{'transfer ms':>13}"
          f"{'transfers':>11}{'right texts':>13}")
    for key, name in NAMES.items():
        if key not in r:
            continue
        m = r[key]
        xfer = f"{m['transfer_ms']:.1f}" if m.get("transfer_ms") is not None else "-"
        leg = f"{m['decode_leg_ms']:.1f}" if key != "colocated" else "-"
        print(f"{name:28}{m['ttft_ms']:>10.1f}{leg:>15}{m['tpot_ms']:>10.1f}{xfer:>13}"
              f"{m.get('transfers', '-'):>11}{m['n'] - m['wrong_texts']:>9}/{m['n']}")
    for key in LEGS:
        ref = "colocated-tp2" if key.endswith("-tp2") else "colocated"
        if key in r and ref in r:
            ratio = r[key]["ttft_ms"] / r[ref]["ttft_ms"]
            print(f"TTFT {key} / {ref}: {ratio:.2f}")
    print("first pull of each pair (connecting; not counted above): " + ", ".join(
        f"{k} {r[k]['first_pull_ms']:.1f} ms" for k in LEGS
        if k in r and r[k].get("first_pull_ms") is not None))
    print(f"\ntransfer by phase, mean ms ({', '.join(PHASES)}; read: the READ alone; own: "
          "the READ by NIXL's clock, as NixlConnector's figure)")
    for key in LEGS:
        ph = r.get(key, {}).get("phases_ms")
        if ph:
            print(f"  {key:13} " + "  ".join(f"{k} {ph[k]:.1f}" for k in PHASES if k in ph))
    for key, nixl_key in (("kvrelay-tcp", "nixl"), ("kvrelay-nixl", "nixl"),
                          ("kvrelay-tcp-tp2", "nixl-tp2")):
        n_ms = r.get(nixl_key, {}).get("transfer_ms")
        m = r.get(key, {})
        if m.get("transfer_ms") and n_ms:
            read, own = m["phases_ms"].get("read"), m["phases_ms"].get("own")
            print(f"transfer {key} / {NAMES[nixl_key]}: READ alone "
                  f"{f'{read / n_ms:.2f}' if read else '-'}"
                  f"{f' (by NIXL clock {own / n_ms:.2f})' if own else ''}, full span "
                  f"(ACQUIRE answered to commit confirmed) {m['transfer_ms'] / n_ms:.2f}")
    if any(k.endswith("_reused") for k in r):
        print("\nreused-block scenario (D stalled past P's lease, P's blocks reused):")
    for key in LEGS:
        if key + "_reused" in r:
            s = r[key + "_reused"]
            verdict = ("error: " + s["error"]) if "error" in s else (
                "right text" if s.get("text") == s.get("want") else "WRONG text (HTTP 200)")
            print(f"  {key:13} {verdict}: {s.get('text', '')[:60]!r}")
    for key in LEGS:
        if key + "_error" in r:
            print(f"\n{NAMES[key]} leg failed: {r[key + '_error'][:2000]}")


if __name__ == "__main__":
    sys.exit(main())
