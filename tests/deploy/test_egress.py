"""Every component's own connections bounded by an egress NetworkPolicy (security audit N-13),
and the console served only under names it is given: the chart rendered offline."""

from __future__ import annotations

import copy
from typing import Any

import helm_python as helm
import pytest

from tests.deploy.conftest import FULLNAME, NAMESPACE, Rendered, load_values, render
from tests.deploy.test_chart import _selects

COMPONENTS = ("proxy", "judge", "learner", "console", "vllm", "endpoint-picker")
COMPONENT = "app.kubernetes.io/component"


def egress_of(r: Rendered, component: str) -> list[dict[str, Any]]:
    """The egress rules that apply to the component's pods (every policy that selects them)."""
    pods = [
        p for p in r.pod_templates().values() if p["metadata"]["labels"].get(COMPONENT) == component
    ]
    assert pods, component
    rules: list[dict[str, Any]] = []
    for policy in r.kinds("NetworkPolicy"):
        spec = policy["spec"]
        if "Egress" in spec.get("policyTypes", []) and _selects(
            spec["podSelector"], pods[0]["metadata"]
        ):
            rules += spec.get("egress", [])
    return rules


def allows(
    rules: list[dict[str, Any]], port: int, protocol: str = "TCP", to: dict[str, str] | None = None
) -> bool:
    """Whether a connection to ``port`` reaches a peer: a pod of these labels, or (None) an
    address outside the cluster that no podSelector names."""
    for rule in rules:
        ports = rule.get("ports")
        if ports and not any(
            p["port"] == port and p.get("protocol", "TCP") == protocol for p in ports
        ):
            continue
        peers = rule.get("to")
        if not peers:
            return True
        for peer in peers:
            in_release = to is not None and set(peer) == {"podSelector"}
            if in_release and _selects(peer["podSelector"], {"labels": to}):
                return True
    return False


def labels(component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "ratchet",
        "app.kubernetes.io/instance": "prod",
        COMPONENT: component,
    }


@pytest.fixture(scope="module")
def all_on(chart: helm.Chart) -> Rendered:
    return render(chart, load_values("all-on"))


@pytest.mark.parametrize("values", ["all-on", "defaults", "existing-vllm", "inference-gateway"])
def test_every_component_has_an_egress_policy(rendered: dict[str, Rendered], values: str) -> None:
    r = rendered[values]
    running = {p["metadata"]["labels"].get(COMPONENT) for p in r.pod_templates().values()}
    for component in set(COMPONENTS) & running:
        rules = egress_of(r, component)
        assert rules, component
        assert allows(rules, 53, "UDP") and allows(rules, 53, "TCP"), component  # DNS
        for port in (22, 5432, 8080):  # nothing it does not talk to
            assert not allows(rules, port), (component, port)


def test_each_component_reaches_only_what_it_talks_to(all_on: Rendered) -> None:
    vllm = labels("vllm")
    for component in ("proxy", "judge", "learner", "console"):
        rules = egress_of(all_on, component)
        assert allows(rules, 9093), component  # Kafka: the bootstrap servers' port
        assert allows(rules, 6380), component  # Redis: redis.url's port
        assert allows(rules, 8000, to=vllm), component  # the chart's vLLM pods
        assert not allows(rules, 8000), component  # ... and no other address on that port
    # The judge (and the learner's gate) reach the judge model over HTTPS; the proxy does not.
    assert allows(egress_of(all_on, "judge"), 443)
    assert allows(egress_of(all_on, "learner"), 443)
    assert not allows(egress_of(all_on, "proxy"), 443)
    # The console reads the proxy's and the judge's /metrics from their pods.
    console = egress_of(all_on, "console")
    assert allows(console, 8400, to=labels("proxy")) and allows(console, 8402, to=labels("judge"))
    assert not allows(console, 8400)
    # vLLM talks to nothing of Ratchet's: DNS and the model hub only.
    rules = egress_of(all_on, "vllm")
    assert allows(rules, 443) and not allows(rules, 9093) and not allows(rules, 6380)


def test_peers_named_narrow_each_rule_and_the_hub_can_be_closed(chart: helm.Chart) -> None:
    values = load_values("all-on")
    kafka = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kafka"}}}]
    hub = [{"ipBlock": {"cidr": "10.9.0.0/16"}}]
    values["networkPolicy"]["egress"] = {"kafkaTo": kafka, "modelHubTo": hub, "judgeModel": False}
    r = render(chart, values)
    proxy = egress_of(r, "proxy")
    kafka_rule = next(
        rule for rule in proxy if {"port": 9093, "protocol": "TCP"} in rule.get("ports", [])
    )
    assert kafka_rule["to"] == kafka
    learner = egress_of(r, "learner")
    hub_rule = next(rule for rule in learner if rule.get("to") == hub)
    assert hub_rule["ports"] == [{"port": 443, "protocol": "TCP"}]
    assert not allows(egress_of(r, "judge"), 443)  # judgeModel off
    values["networkPolicy"]["egress"]["modelHub"] = False
    rules = egress_of(render(chart, values), "vllm")
    assert all(p["port"] == 53 for rule in rules for p in rule["ports"])  # DNS alone


def test_vllm_elsewhere_is_reached_on_its_own_port(rendered: dict[str, Rendered]) -> None:
    proxy = egress_of(rendered["existing-vllm"], "proxy")
    assert allows(proxy, 8000) and not allows(proxy, 8400)
    gateway = rendered["inference-gateway"]
    assert allows(egress_of(gateway, "proxy"), 80)  # the gateway's listener
    picker = egress_of(gateway, "endpoint-picker")
    assert allows(picker, 443) and allows(picker, 6443)  # the Kubernetes API
    assert allows(picker, 8000, to=labels("vllm")) and not allows(picker, 8000)
    assert not allows(picker, 9092)


def test_egress_policies_can_be_turned_off(chart: helm.Chart) -> None:
    values = copy.deepcopy(load_values("all-on"))
    values["networkPolicy"]["egress"] = {"enabled": False}
    r = render(chart, values)
    assert not [p for p in r.kinds("NetworkPolicy") if "Egress" in p["spec"]["policyTypes"]]


def test_the_console_serves_its_service_names_unless_told_others(
    all_on: Rendered, chart: helm.Chart
) -> None:
    service = f"{FULLNAME}-console"
    assert all_on.has("Service", service)
    assert all_on.config["console"]["allowed_hosts"] == [
        service,
        f"{service}.{NAMESPACE}",
        f"{service}.{NAMESPACE}.svc",
        f"{service}.{NAMESPACE}.svc.cluster.local",
    ]
    values = load_values("all-on")
    values["console"]["config"]["allowed_hosts"] = ["console.example.com"]
    assert render(chart, values).config["console"]["allowed_hosts"] == ["console.example.com"]
