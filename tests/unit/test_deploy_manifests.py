"""docs/deploy.md's Kubernetes manifests are valid Kubernetes objects, drain as the
engines do, and every flag they pass to kvrelay exists.

The YAML blocks of the page are parsed with PyYAML. Each object is validated against
Kubernetes' own OpenAPI schemas by ``kubernetes-validate`` (strict: an unknown or
misspelt field fails), those of the oldest and the newest version named in the docs,
which the package ships: no network (the test cuts it off to be sure). Every
container's command and args are collected, the kvrelay subcommand (serve or proxy) is
found, and each ``--flag`` is looked up in the real ``kvrelay serve --help`` /
``kvrelay proxy --help`` output (the same parsers the CLI uses), so a renamed or
removed flag fails here.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

DOC = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
FLAG = re.compile(r"--[a-z][a-z0-9-]*")
K8S_VERSIONS = ("1.29", "1.37")  # as docs/deploy.md says
# What an engine may still take after its grace period: 5 s for aborted responses to
# end, 10 s for steps and transfers to stop (docs/server.md, "Shutdown").
EXIT_AFTER_GRACE_S = 15


def yaml_documents() -> list[Any]:
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks, "docs/deploy.md has no yaml blocks"
    return [d for b in blocks for d in yaml.safe_load_all(b) if d is not None]


def containers(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        if "name" in node and ("args" in node or "command" in node):
            yield node
        for v in node.values():
            yield from containers(v)
    elif isinstance(node, list):
        for v in node:
            yield from containers(v)


def help_text(command: str) -> str:
    from kvrelay.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    return out.getvalue()


def known_flags(command: str) -> set[str]:
    return set(FLAG.findall(help_text(command)))


def is_kvrelay(container: dict[str, Any]) -> bool:
    """kvrelay's image (a patch names none: it patches a kvrelay container), not a
    sidecar of another project's."""
    return "kvrelay" in container.get("image", "kvrelay")


def invocations() -> list[tuple[str, str, list[str]]]:
    """(container, subcommand, argv after it) for every kvrelay container."""
    out = []
    for c in (c for doc in yaml_documents() for c in containers(doc) if is_kvrelay(c)):
        argv = [str(a) for a in (c.get("command") or []) + (c.get("args") or [])]
        if argv and argv[0] == "kvrelay":
            argv = argv[1:]
        sub = argv[0] if argv and argv[0] in ("serve", "proxy") else "serve"
        out.append((c["name"], sub, argv[1:] if argv and argv[0] == sub else argv))
    return out


def test_manifests_parse_and_hold_the_deployment_the_docs_describe() -> None:
    docs = [d for d in yaml_documents() if "kind" in d]
    kinds = [(d["kind"], d["metadata"]["name"]) for d in docs]
    for want in [("Secret", "kvrelay-secrets"), ("Deployment", "kvrelay-prefill-0"),
                 ("Deployment", "kvrelay-decode-0"), ("Deployment", "kvrelay-proxy"),
                 ("Service", "kvrelay")]:
        assert want in kinds
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        spec = d["spec"]["template"]["spec"]
        assert d["spec"]["selector"]["matchLabels"].items() <= \
            d["spec"]["template"]["metadata"]["labels"].items()
        for c in spec["containers"]:
            assert "requests" in c["resources"] and "limits" in c["resources"]
            if not is_kvrelay(c):
                continue
            assert c["readinessProbe"]["httpGet"]["path"] == "/health"
            secrets = [e for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]
            if "--role=prefill" in c["args"] or "--role=decode" in c["args"]:
                assert any(e["name"] == "KVRELAY_RELAY_SECRET" for e in secrets)
                assert not any("--relay-secret" in a for a in c["args"]), "secret in argv"


def test_every_flag_in_the_manifests_exists_in_the_cli() -> None:
    known = {"serve": known_flags("serve"), "proxy": known_flags("proxy")}
    assert "--relay-host" in known["serve"] and "--decode" in known["proxy"]
    used = invocations()
    assert {sub for _, sub, _ in used} == {"serve", "proxy"}
    unknown = [(name, sub, flag) for name, sub, argv in used for a in argv
               if a.startswith("--") for flag in [a.split("=", 1)[0]]
               if flag not in known[sub]]
    assert not unknown, f"flags the CLI does not have: {unknown}"


def test_the_check_catches_a_flag_that_does_not_exist() -> None:
    known = known_flags("serve")
    assert "--kv-transport" in known and "--relay-hots" not in known
    # and the serve parser itself would refuse it
    from kvrelay.server.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="cmd"))
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        parser.parse_args(["serve", "--relay-hots=1.2.3.4"])


def test_every_invocation_parses_with_the_real_parser() -> None:
    """Values too: choices (--kv-transport=nixl), numbers; $(VAR) as Kubernetes expands it."""
    from kvrelay.cli import build_parser

    for name, sub, argv in invocations():
        expanded = [re.sub(r"\$\([A-Z_]+\)", "10.0.0.7", a) for a in argv]
        with contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                build_parser().parse_args([sub, *expanded])
            except SystemExit:
                pytest.fail(f"{name}: kvrelay {sub} {' '.join(expanded)}: {err.getvalue()}")


# Custom resources the page declares, checked by their own test (kubernetes-validate
# knows the built-in kinds only).
CUSTOM = ("InferencePool",)


def objects() -> list[dict[str, Any]]:
    """The whole built-in Kubernetes objects of the page (not the partial patches)."""
    return [d for d in yaml_documents()
            if "kind" in d and "apiVersion" in d and d["kind"] not in CUSTOM]


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"the schema check reached for the network: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_is_valid_against_the_kubernetes_schemas(version: str) -> None:
    import kubernetes_validate

    docs = objects()
    assert len(docs) >= 8
    for d in docs:
        try:
            kubernetes_validate.validate(d, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{d['kind']} {d['metadata']['name']} (Kubernetes {version}): "
                        f"{exc.message}")


@pytest.mark.usefixtures("no_network")
def test_the_schema_check_catches_a_misspelt_or_mistyped_field() -> None:
    import kubernetes_validate

    deployment = next(d for d in objects() if d["kind"] == "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    bad = [{**spec, "terminationGracePeriodSecond": 45},  # a typo: strict refuses it
           {**spec, "terminationGracePeriodSeconds": "45"}]  # a string, not an integer
    for b in bad:
        d = {**deployment, "spec": {**deployment["spec"],
                                    "template": {**deployment["spec"]["template"], "spec": b}}}
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(d, K8S_VERSIONS[-1], strict=True)


def _flag(args: list[str], name: str, default: float) -> float:
    for a in args:
        if a.startswith(f"{name}="):
            return float(a.split("=", 1)[1])
    return default


def test_engines_get_the_grace_period_their_drain_needs_and_stay_reachable() -> None:
    """terminationGracePeriodSeconds covers --shutdown-timeout and the exit after it;
    no preStop delays the drain; each engine's Service keeps a draining pod reachable;
    the proxy, which stops accepting on SIGTERM, sleeps in preStop first."""
    from kvrelay.cli import build_parser

    default = build_parser().parse_args(["serve"]).shutdown_timeout
    docs = objects()
    services = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Service"}
    engines = 0
    for d in (d for d in docs if d["kind"] == "Deployment"):
        spec = d["spec"]["template"]["spec"]
        labels = d["spec"]["template"]["metadata"]["labels"]
        for c in filter(is_kvrelay, spec["containers"]):
            if c["args"][0] == "proxy":
                assert "sleep" in c["lifecycle"]["preStop"]["exec"]["command"]
                continue
            engines += 1
            grace = _flag(c["args"], "--shutdown-timeout", default)
            assert spec["terminationGracePeriodSeconds"] >= grace + EXIT_AFTER_GRACE_S, \
                d["metadata"]["name"]
            assert "preStop" not in c.get("lifecycle", {}), "SIGTERM itself drains"
            if any(p["selector"]["matchLabels"].items() <= labels.items() for p in pools()):
                continue  # llm-d's picker reaches the pods themselves, by the pool
            mine = [s for s in services.values() if s["selector"].items() <= labels.items()]
            assert mine, d["metadata"]["name"]  # its own, and the role's headless one
            assert all(s.get("publishNotReadyAddresses") is True for s in mine), \
                d["metadata"]["name"]
    assert engines == 2 + 2  # the manifests' P and D, and llm-d's (no Service)


def pools() -> list[dict[str, Any]]:
    return [d["spec"] for d in yaml_documents() if d.get("kind") == "InferencePool"]


def test_the_inference_pool_is_a_v1_pool_of_kvrelay_pods_with_llm_d_roles() -> None:
    """The InferencePool's fields as inference.networking.k8s.io/v1 has them
    (gateway-api-inference-extension v1.0, config/crd/bases/
    inference.networking.k8s.io_inferencepools.yaml: targetPorts with one number,
    selector.matchLabels, endpointPickerRef with name, port.number and failureMode),
    and it selects engine pods of both llm-d roles whose port it names."""
    docs = [d for d in yaml_documents() if d.get("kind") == "InferencePool"]
    assert len(docs) == 1
    pool = docs[0]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) <= {"targetPorts", "selector", "endpointPickerRef"}
    assert set(spec["selector"]) == {"matchLabels"}
    (port,) = spec["targetPorts"]
    assert set(port) == {"number"} and 1 <= port["number"] <= 65535
    ref = spec["endpointPickerRef"]
    assert set(ref) <= {"name", "kind", "group", "port", "failureMode"} and ref["name"]
    assert set(ref["port"]) == {"number"} and ref.get("failureMode") in (
        None, "FailOpen", "FailClose")
    selected = [d for d in objects() if d["kind"] == "Deployment" and spec["selector"][
        "matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
    roles = {d["spec"]["template"]["metadata"]["labels"]["llm-d.ai/role"] for d in selected}
    assert roles == {"prefill", "decode"}
    for d in selected:  # the pool's port is the first container's (engine or sidecar)
        first = d["spec"]["template"]["spec"]["containers"][0]
        assert port["number"] in [p["containerPort"] for p in first["ports"]]


def test_engine_pods_carry_llm_d_role_labels() -> None:
    """llm-d.ai/role on every engine pod, as its --role (both: prefill-decode)."""
    want = {"prefill": "prefill", "decode": "decode", "both": "prefill-decode"}
    for d in (d for d in objects() if d["kind"] == "Deployment"):
        labels = d["spec"]["template"]["metadata"]["labels"]
        for c in filter(is_kvrelay, d["spec"]["template"]["spec"]["containers"]):
            if c["args"][0] == "proxy":
                continue
            role = next((a.split("=", 1)[1] for a in c["args"] if a.startswith("--role=")),
                        "both")
            assert labels.get("llm-d.ai/role") == want[role], d["metadata"]["name"]
