"""The chart's large-fleet mode: vLLM's pods as a Gateway API Inference Extension InferencePool,
placed by llm-d's endpoint picker, the pool and its HTTPRoute checked against the published CRD
schemas vendored in helm/vendor/, and Ratchet's components sent through the Gateway."""

from __future__ import annotations

import copy
import functools
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml

from tests.deploy.conftest import FULLNAME, NAMESPACE, ROOT, Rendered, load_values, render
from tests.deploy.test_chart import _ports, _selects

VENDOR = ROOT / "helm" / "vendor"
CRDS = {
    "InferencePool": "inference.networking.k8s.io_inferencepools.yaml",
    "HTTPRoute": "gateway.networking.k8s.io_httproutes.yaml",
}
POOL, PICKER = f"{FULLNAME}-vllm", f"{FULLNAME}-endpoint-picker"
# vLLM's routes that change or reveal what it serves: never behind the Gateway.
ADMIN_PATHS = ["/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/adapters", "/tokenize"]


@functools.cache
def crd_schema(kind: str, api_version: str) -> dict[str, Any]:
    crd = yaml.safe_load((VENDOR / CRDS[kind]).read_text())
    assert crd["spec"]["names"]["kind"] == kind
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group
    served = {v["name"]: v for v in crd["spec"]["versions"]}
    assert version in served and served[version]["served"], (kind, api_version)
    return served[version]["schema"]["openAPIV3Schema"]


def validate(obj: dict[str, Any]) -> None:
    """The object against its CRD's structural schema (OpenAPI v3, which jsonschema reads; the
    x-kubernetes-* keys and CEL rules are the API server's and are not checked here)."""
    jsonschema.validate(obj, crd_schema(obj["kind"], obj["apiVersion"]))


@pytest.fixture(scope="module")
def fleet(chart: helm.Chart) -> Rendered:
    return render(chart, load_values("inference-gateway"))


def test_the_pool_and_its_route_validate_against_the_published_crds(fleet: Rendered) -> None:
    pool, route = fleet.get("InferencePool", POOL), fleet.get("HTTPRoute", POOL)
    validate(pool)
    validate(route)
    # The schemas bite: a pool without its selector, a port out of range, a route to a pool
    # whose group is misspelt as a name too long for the API.
    broken = copy.deepcopy(pool)
    del broken["spec"]["selector"]
    with pytest.raises(jsonschema.ValidationError, match="selector"):
        validate(broken)
    broken = copy.deepcopy(pool)
    broken["spec"]["targetPorts"] = [{"number": 70000}]
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)
    broken = copy.deepcopy(route)
    broken["spec"]["rules"][0]["backendRefs"][0]["group"] = "x" * 300
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


def test_the_pool_is_the_vllm_pods_and_names_its_picker(fleet: Rendered) -> None:
    pool = fleet.get("InferencePool", POOL)["spec"]
    vllm = fleet.get("Deployment", f"{FULLNAME}-vllm")["spec"]["template"]
    assert _selects(pool["selector"], vllm["metadata"])
    picker_pod = fleet.get("Deployment", PICKER)["spec"]["template"]
    assert not _selects(pool["selector"], picker_pod["metadata"])
    http = _ports(next(c for c in vllm["spec"]["containers"] if c["name"] == "vllm"))["http"]
    assert pool["targetPorts"] == [{"number": http}]
    ref = pool["endpointPickerRef"]
    service = fleet.get("Service", ref["name"])
    assert ref["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    assert _selects(service["spec"]["selector"], picker_pod["metadata"])
    assert ref["failureMode"] == "FailOpen"


def test_only_what_ratchet_sends_is_routed_for_the_named_hosts_and_listener(
    fleet: Rendered,
) -> None:
    route = fleet.get("HTTPRoute", POOL)["spec"]
    # One listener of the shared Gateway, and only the named hosts (audit N-13).
    assert route["parentRefs"] == [
        {
            "group": "gateway.networking.k8s.io",
            "kind": "Gateway",
            "name": "inference-gateway",
            "namespace": "gateway-system",
            "sectionName": "internal",
        }
    ]
    assert route["hostnames"] == ["inference-gateway-istio.gateway-system.svc"]
    (rule,) = route["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": POOL}
    ]
    paths = {m["path"]["value"] for m in rule["matches"]}
    assert all(m["path"]["type"] == "Exact" for m in rule["matches"])
    # What the proxy (proxy/upstream.py: FORWARDED_PATHS, /health, GET /v1/models), the judge
    # and the gate send vLLM; /v1/responses is the proxy's own, answered through chat.
    assert paths == {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"}
    assert not paths & set(ADMIN_PATHS)


def test_ratchet_reaches_vllm_through_the_gateway(fleet: Rendered) -> None:
    config = fleet.config
    assert config["vllm_url"] == "http://inference-gateway-istio.gateway-system.svc:80"
    assert "vllm_endpoints" not in config  # the picker places requests, not Ratchet
    assert not fleet.has("Service", f"{FULLNAME}-vllm-replicas")
    assert fleet.get("Deployment", f"{FULLNAME}-vllm")["spec"]["replicas"] == 4


def test_the_picker_places_by_adapter_prefix_and_load(fleet: Rendered) -> None:
    data = fleet.get("ConfigMap", PICKER)["data"]
    config = yaml.safe_load(data["ratchet-plugins.yaml"])
    assert config["kind"] == "EndpointPickerConfig"
    types = {p["type"] for p in config["plugins"]}
    assert {"lora-affinity-scorer", "prefix-cache-scorer", "metrics-data-source"} <= types
    (profile,) = config["schedulingProfiles"]
    weights = {p["pluginRef"]: p["weight"] for p in profile["plugins"]}
    assert weights == {  # the chart's defaults
        "lora-affinity-scorer": 3,
        "prefix-cache-scorer": 3,
        "queue-scorer": 2,
        "kv-cache-utilization-scorer": 2,
    }
    picker = fleet.container(PICKER)
    args = dict(a.removeprefix("--").partition("=")[::2] for a in picker["args"])
    assert args["pool-name"] == POOL and args["pool-namespace"] == NAMESPACE
    assert args["config-file"] == "/config/ratchet-plugins.yaml"
    assert "ha-enable-leader-election" in args  # two pickers: one leads
    mount = next(m for m in picker["volumeMounts"] if m["name"] == "config")
    assert mount["mountPath"] == "/config" and mount["readOnly"]


def test_the_picker_may_read_its_pool_and_pods_and_nothing_else(fleet: Rendered) -> None:
    role = fleet.get("Role", PICKER)
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert ("", "pods", "watch") in granted
    assert ("inference.networking.k8s.io", "inferencepools", "watch") in granted
    writes = {(g, r) for g, r, v in granted if v not in ("get", "list", "watch")}
    assert writes == {("coordination.k8s.io", "leases")}  # the leader election, and only that
    assert not any(r == "secrets" for _, r, _ in granted)
    binding = fleet.get("RoleBinding", PICKER)
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": PICKER, "namespace": NAMESPACE}
    ]


def test_the_picker_rolls_when_its_scorers_change(chart: helm.Chart, fleet: Rendered) -> None:
    def checksum(r: Rendered) -> str:
        pod = r.get("Deployment", PICKER)["spec"]["template"]
        return str(pod["metadata"]["annotations"]["checksum/config"])

    values = load_values("inference-gateway")
    assert checksum(render(chart, values)) == checksum(fleet)
    values["inferenceGateway"]["endpointPicker"]["scorers"] = {"lora-affinity-scorer": 5}
    assert checksum(render(chart, values)) != checksum(fleet)


def test_the_picker_and_the_gateway_may_reach_vllm(fleet: Rendered) -> None:
    policy = fleet.get("NetworkPolicy", f"{FULLNAME}-vllm")["spec"]["ingress"][0]["from"]
    picker_pod = fleet.get("Deployment", PICKER)["spec"]["template"]
    assert any(
        "podSelector" in peer and _selects(peer["podSelector"], picker_pod["metadata"])
        for peer in policy
    )
    gateway = load_values("inference-gateway")["inferenceGateway"]["from"][0]
    assert gateway in policy


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"gateway": {"name": ""}}, "inferenceGateway.gateway.name is empty"),
        ({"url": ""}, "inferenceGateway.url is empty"),
        (
            {"gateway": {"name": "inference-gateway", "sectionName": ""}},
            "inferenceGateway.gateway.sectionName is empty",
        ),
        (
            {"hostnames": []},
            "inferenceGateway.hostnames is empty: name the host names the HTTPRoute answers "
            "for, at least the host of inferenceGateway.url (inference-gateway-istio.",
        ),
        (
            {"hostnames": ["models.example.com"]},
            "inferenceGateway.hostnames does not include the host of inferenceGateway.url",
        ),
    ],
)
def test_an_incomplete_gateway_is_refused_with_the_fix(
    chart: helm.Chart, change: dict[str, Any], message: str
) -> None:
    values = load_values("inference-gateway")
    values["inferenceGateway"] = {**values["inferenceGateway"], **change}
    with pytest.raises(helm.HelmRenderError) as exc:
        render(chart, values)
    assert message in str(exc.value)


def test_the_gateway_mode_needs_the_charts_own_vllm(chart: helm.Chart) -> None:
    values = load_values("inference-gateway")
    values["vllm"] = {"enabled": False, "url": "http://vllm.inference:8000"}
    with pytest.raises(helm.HelmRenderError) as exc:
        render(chart, values)
    assert "inferenceGateway.enabled needs vllm.enabled" in str(exc.value)


def test_off_by_default(chart: helm.Chart) -> None:
    r = render(chart, load_values("defaults"))
    assert not r.kinds("InferencePool") and not r.kinds("HTTPRoute")
    assert not any(o["metadata"]["name"] == PICKER for o in r.objects)


def test_a_wildcard_hostname_covers_the_gateways_host(chart: helm.Chart) -> None:
    values = load_values("inference-gateway")
    values["inferenceGateway"]["hostnames"] = ["*.gateway-system.svc"]
    route = render(chart, values).get("HTTPRoute", POOL)["spec"]
    assert route["hostnames"] == ["*.gateway-system.svc"]
    validate(render(chart, values).get("HTTPRoute", POOL))
