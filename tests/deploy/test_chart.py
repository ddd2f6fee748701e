"""The chart renders, lints strictly and validates against Kubernetes for every values file,
and what it renders is what a GPU deployment of Ratchet needs."""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
from redis.connection import parse_url

from ratchet import settings as ratchet_settings
from ratchet.secrets import redis_connection_url
from tests.deploy.conftest import (
    CHART,
    FULLNAME,
    NAMESPACE,
    ROOT,
    VALUES_FILES,
    Rendered,
    load_values,
    render,
)
from tests.deploy.test_config import (
    _load_in_pod,
    _same_bounds,
    container_env,
    container_inputs,
    container_secret_files,
    secret_file_refs,
)

# The newest Kubernetes kubernetes-validate 1.37 ships schemas for, and the oldest the chart
# declares (Chart.yaml kubeVersion), so nothing newer than that floor slips in.
KUBE_VERSIONS = ["1.37.0", "1.29.0"]
# Objects of CRDs have no upstream schema; they are checked field by field below.
CRD_KINDS = {"ServiceMonitor", "InferencePool", "HTTPRoute"}
RATCHET_COMPONENTS = ("proxy", "judge", "learner", "console")
SENTINEL = "SENTINEL"


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_lints_strictly(values_file: str) -> None:
    report = helm.lint(
        CHART, load_values(values_file), strict=True, namespace=NAMESPACE, kube_version="v1.37.0"
    )
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], problems or report["errors"]


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_manifests_validate_against_kubernetes(
    rendered: dict[str, Rendered], values_file: str, kube_version: str
) -> None:
    objects = rendered[values_file].objects
    assert objects
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} at {where}: {exc.message}")


def test_components_switch_on_and_off(rendered: dict[str, Rendered]) -> None:
    defaults = rendered["defaults"]
    assert defaults.names() == {
        f"ConfigMap/{FULLNAME}-config",
        f"ConfigMap/{FULLNAME}-vllm-guard",
        f"Secret/{FULLNAME}-secrets",
        f"Secret/{FULLNAME}-server",
        f"ServiceAccount/{FULLNAME}",
        f"PersistentVolumeClaim/{FULLNAME}-adapters",
        f"Deployment/{FULLNAME}-proxy",
        f"Service/{FULLNAME}-proxy",
        f"PodDisruptionBudget/{FULLNAME}-proxy",
        f"Deployment/{FULLNAME}-judge",
        f"Service/{FULLNAME}-judge",
        f"PodDisruptionBudget/{FULLNAME}-judge",
        f"Deployment/{FULLNAME}-learner",
        f"Service/{FULLNAME}-learner",
        f"Deployment/{FULLNAME}-vllm",
        f"Service/{FULLNAME}-vllm",
        f"NetworkPolicy/{FULLNAME}-vllm",
        f"NetworkPolicy/{FULLNAME}-metrics",
        *(f"NetworkPolicy/{FULLNAME}-{c}-egress" for c in ("proxy", "judge", "learner", "vllm")),
        f"Pod/{FULLNAME}-test-proxy",
    }
    everything = rendered["all-on"]
    for kind, name in [
        ("Deployment", "judge"),
        ("Service", "judge"),
        ("Deployment", "learner"),
        ("Service", "learner"),
        ("HorizontalPodAutoscaler", "proxy"),
        ("Secret", "judge"),
    ]:
        assert everything.has(kind, f"{FULLNAME}-{name}"), (kind, name)
    existing = rendered["existing-vllm"]
    ingress = [p for p in existing.kinds("NetworkPolicy") if "Ingress" in p["spec"]["policyTypes"]]
    assert [p["metadata"]["name"] for p in ingress] == [
        f"{FULLNAME}-metrics"  # no vLLM here to guard
    ]
    assert not existing.has("ConfigMap", f"{FULLNAME}-vllm-guard")
    assert not existing.has("Deployment", f"{FULLNAME}-vllm")
    assert not existing.has("Service", f"{FULLNAME}-vllm")
    # The learner writes the claim the existing vLLM reads; the chart makes none.
    assert not existing.kinds("PersistentVolumeClaim")
    pod = existing.get("Deployment", f"{FULLNAME}-learner")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["adapters"]["persistentVolumeClaim"]["claimName"] == "vllm-adapters"


def test_judge_and_learner_switch_off(chart: helm.Chart) -> None:
    values = load_values("defaults")
    off = {"enabled": False}
    r = render(
        chart,
        {**values, "judge": {**off, "apiKey": "sk-SENTINEL-unused"}, "learner": off},
    )
    assert not [n for n in r.names() if "judge" in n or "learner" in n]
    assert "judge" not in r.config and "learner" not in r.config
    # vLLM still mounts the adapter store.
    assert r.has("PersistentVolumeClaim", f"{FULLNAME}-adapters")


def test_learner_without_judge_keeps_the_judge_settings(chart: helm.Chart) -> None:
    """The gate judges pairs with the judge's model settings, key and verifier secrets, so a
    release whose judge runs elsewhere still gives them to the learner."""
    values = load_values("defaults")
    judge = {
        "enabled": False,
        "config": {"judge_api_base": "https://api.openai.com/v1"},
        "apiKey": "sk-SENTINEL-gate",
    }
    r = render(chart, {**values, "judge": judge})
    assert not r.has("Deployment", f"{FULLNAME}-judge")
    assert r.config["judge"]["judge_api_base"] == "https://api.openai.com/v1"
    assert r.has("Secret", f"{FULLNAME}-judge")
    learner = r.get("Deployment", f"{FULLNAME}-learner")["spec"]["template"]
    assert learner["spec"]["containers"][0]["envFrom"] == [
        {"secretRef": {"name": f"{FULLNAME}-judge"}}
    ]
    assert "checksum/judge-secret" in learner["metadata"]["annotations"]


def test_judge_and_learner_on_by_default(chart: helm.Chart) -> None:
    assert chart.values["judge"]["enabled"] is True
    assert chart.values["learner"]["enabled"] is True
    assert chart.values["networkPolicy"]["enabled"] is True


def test_commands_ports_and_probes(rendered: dict[str, Rendered], chart: helm.Chart) -> None:
    r = rendered["all-on"]
    proxy = r.container(f"{FULLNAME}-proxy")
    assert proxy["command"] == ["ratchet", "proxy", "--config", "/etc/ratchet/ratchet.yaml"]
    assert _ports(proxy) == {"http": 8400}
    assert _probe(proxy, "startupProbe") == ("/healthz", "http")
    assert _probe(proxy, "livenessProbe") == ("/healthz", "http")
    assert _probe(proxy, "readinessProbe") == ("/readyz", "http")
    chart_owned = {
        "judge": {},
        # The weights vLLM serves, which every adapter must name as its base.
        "learner": {"base_model_path": "meta-llama/Llama-3.1-8B-Instruct"},
    }
    for name, port in [("judge", 8402), ("learner", 8403)]:
        c = r.container(f"{FULLNAME}-{name}")
        assert c["command"] == ["ratchet", name, "--config", "/etc/ratchet/ratchet.yaml"]
        assert _ports(c) == {"metrics": port}
        # The services serve only Prometheus metrics: every probe asks /metrics.
        for probe in ("livenessProbe", "readinessProbe"):
            assert _probe(c, probe) == ("/metrics", "metrics")
        # The service binds its metrics where probes and Prometheus reach them; the rest of its
        # section is the chart's defaults with the values' config on top.
        assert r.config[name] == {
            **chart.values[name]["config"],
            **load_values("all-on")[name].get("config", {}),
            **chart_owned[name],
            "metrics_host": "0.0.0.0",
            "metrics_port": port,
        }
    learner = r.container(f"{FULLNAME}-learner")
    assert _probe(learner, "startupProbe") == ("/metrics", "metrics")
    startup = learner["startupProbe"]
    # Room to download and load the base model before liveness starts counting.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60
    vllm = r.container(f"{FULLNAME}-vllm")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert _probe(vllm, probe) == ("/health", "http")
    startup = vllm["startupProbe"]
    # Long enough to download and load a model before liveness starts counting.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_every_probe_and_service_uses_a_named_port(
    rendered: dict[str, Rendered], values_file: str
) -> None:
    r = rendered[values_file]
    pods = r.pod_templates()
    for pod_name, pod in pods.items():
        for c in pod["spec"]["containers"]:
            names = set(_ports(c))
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                if probe in c and "grpc" in c[probe]:  # a gRPC probe's port is a number
                    port = c[probe]["grpc"]["port"]
                    numbers = {p["containerPort"] for p in c["ports"]}
                    assert port in numbers, (pod_name, probe, port)
                elif probe in c:
                    port = c[probe]["httpGet"]["port"]
                    assert isinstance(port, str) and port in names, (pod_name, probe, port)
    for svc in r.kinds("Service"):
        selected = [
            p for p in pods.values() if _selects(svc["spec"]["selector"], p["metadata"]["labels"])
        ]
        assert selected, f"Service {svc['metadata']['name']} selects no pod"
        for port in svc["spec"]["ports"]:
            assert isinstance(port["targetPort"], str)
            for pod in selected:
                assert any(port["targetPort"] in _ports(c) for c in pod["spec"]["containers"])


def test_vllm_serves_lora_from_the_adapter_store(rendered: dict[str, Rendered]) -> None:
    r = rendered["defaults"]
    pod = r.get("Deployment", f"{FULLNAME}-vllm")["spec"]["template"]["spec"]
    vllm = pod["containers"][0]
    assert vllm["image"].startswith("vllm/vllm-openai:v")
    args = vllm["args"]
    assert args[0] == "Qwen/Qwen2.5-1.5B-Instruct"
    assert _flag(args, "--served-model-name") == "qwen2.5-1.5b-instruct"
    assert "--enable-lora" in args
    assert _flag(args, "--max-loras") == "4"
    assert _flag(args, "--max-lora-rank") == "32"
    assert "--max-cpu-loras" not in args  # vLLM's default
    assert _flag(args, "--port") == "8000"
    env = _env(vllm)
    store = r.config["store_dir"]
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert env["VLLM_PLUGINS"] == "lora_filesystem_resolver"
    assert env["VLLM_LORA_RESOLVER_CACHE_DIR"] == store
    mounts = {m["name"]: m for m in vllm["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["adapters"]["mountPath"] == store and mounts["adapters"]["readOnly"] is True
    claim = volumes["adapters"]["persistentVolumeClaim"]["claimName"]
    pvc = r.get("PersistentVolumeClaim", claim)
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert mounts["dshm"]["mountPath"] == "/dev/shm"
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    # Every alias's base model is the name vLLM serves the base model under.
    assert {a["base_model"] for a in r.config["aliases"].values()} == {"qwen2.5-1.5b-instruct"}
    assert r.config["vllm_url"] == f"http://{FULLNAME}-vllm:8000"
    # A Service link would set VLLM_PORT, which vLLM reads.
    assert pod["enableServiceLinks"] is False


def test_vllm_extra_flags_and_token(rendered: dict[str, Rendered]) -> None:
    vllm = rendered["all-on"].container(f"{FULLNAME}-vllm")
    args = vllm["args"]
    assert _flag(args, "--served-model-name") == "llama-3.1-8b"
    assert _flag(args, "--max-loras") == "8"
    assert _flag(args, "--max-cpu-loras") == "32"
    assert _flag(args, "--max-lora-rank") == "64"
    assert _flag(args, "--max-model-len") == "8192"
    assert args[-3:] == ["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    token = next(e for e in vllm["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}


def test_existing_vllm_by_url(rendered: dict[str, Rendered]) -> None:
    r = rendered["existing-vllm"]
    assert r.config["vllm_url"] == "http://vllm.inference.svc:8000"
    assert {a["base_model"] for a in r.config["aliases"].values()} == {"qwen-7b"}
    assert "WARNING" not in r.files["ratchet/templates/NOTES.txt"]
    assert "vLLM is external" in r.files["ratchet/templates/NOTES.txt"]


def test_gpu_learner(rendered: dict[str, Rendered]) -> None:
    r = rendered["gpu-learner"]
    values = load_values("gpu-learner")
    deployment = r.get("Deployment", f"{FULLNAME}-learner")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    learner = pod["containers"][0]
    assert learner["image"] == "registry.example.com/ratchet-learner:0.1.0-cu128"
    assert learner["imagePullPolicy"] == "Always"
    assert learner["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert learner["resources"]["requests"]["nvidia.com/gpu"] == 2
    # Two GPUs, two ranks: torchrun starts one learner process per GPU (learner/parallel.py).
    assert learner["command"] == [
        "torchrun", "--standalone", "--nproc-per-node", "2",
        "-m", "cli", "learner", "--config", "/etc/ratchet/ratchet.yaml",
    ]  # fmt: skip
    one_gpu = rendered["defaults"].container(f"{FULLNAME}-learner")
    assert one_gpu["command"] == ["ratchet", "learner", "--config", "/etc/ratchet/ratchet.yaml"]
    assert learner["resources"]["limits"]["memory"] == "32Gi"
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert {t["key"] for t in pod["tolerations"]} == {"nvidia.com/gpu", "dedicated"}
    # The learner writes the adapter store that vLLM reads, on the operator's claim.
    mounts = {m["name"]: m for m in learner["volumeMounts"]}
    assert mounts["adapters"]["mountPath"] == r.config["store_dir"]
    assert not mounts["adapters"].get("readOnly", False)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["adapters"]["persistentVolumeClaim"]["claimName"] == "shared-adapters"
    vllm_pod = r.get("Deployment", f"{FULLNAME}-vllm")["spec"]["template"]["spec"]
    vllm_volumes = {v["name"]: v for v in vllm_pod["volumes"]}
    assert vllm_volumes["adapters"]["persistentVolumeClaim"]["claimName"] == "shared-adapters"
    assert not r.kinds("PersistentVolumeClaim")
    assert mounts["dshm"]["mountPath"] == "/dev/shm"
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    # The learner still runs as the image's non-root user with a read-only root.
    assert learner["securityContext"]["readOnlyRootFilesystem"] is True
    # It trains the model vLLM serves, downloaded into the operator's cache with their token,
    # on the GPUs it asked for.
    config = r.config["learner"]
    assert (
        config["base_model_path"]
        == values["model"]["name"]
        == r.container(f"{FULLNAME}-vllm")["args"][0]
    )
    assert config["device"] == "cuda"
    assert config["lora"]["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert (config["batch_groups"], config["interval_s"], config["loss"]["mode"]) == (
        32,
        1800,
        "cispo",
    )
    env = {e["name"]: e for e in learner["env"]}
    assert env["HF_HOME"]["value"] == mounts["model-cache"]["mountPath"] == "/models-cache"
    assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == "hf-models"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "hf-learner-token",
        "key": "HF_TOKEN",
    }
    assert learner["startupProbe"]["periodSeconds"] == 20
    assert learner["startupProbe"]["failureThreshold"] == 135
    # No judge key in this release: nothing to read from a judge Secret.
    assert "envFrom" not in learner


def test_learner_defaults(rendered: dict[str, Rendered], chart: helm.Chart) -> None:
    r = rendered["defaults"]
    learner = r.container(f"{FULLNAME}-learner")
    # The CUDA build of the Ratchet image (ops/README.md), on one GPU.
    assert learner["image"] == "ghcr.io/ratchet/ratchet:0.1.0-cu128"
    assert learner["imagePullPolicy"] == "IfNotPresent"
    assert learner["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert r.config["learner"]["device"] == "cuda"
    assert r.config["learner"]["base_model_path"] == "Qwen/Qwen2.5-1.5B-Instruct"
    assert "HF_TOKEN" not in {e["name"] for e in learner["env"]}
    pod = r.get("Deployment", f"{FULLNAME}-learner")["spec"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    # An explicit device wins; vLLM's token serves a gated model to the learner too.
    everything = rendered["all-on"]
    assert everything.config["learner"]["device"] == "auto"
    token = next(
        e for e in everything.container(f"{FULLNAME}-learner")["env"] if e["name"] == "HF_TOKEN"
    )
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    # Without a GPU the chart leaves the device to the learner (auto).
    values = load_values("defaults")
    cpu = render(chart, {**values, "learner": {"gpu": {"count": 0}}})
    assert "device" not in cpu.config["learner"]
    assert "nvidia.com/gpu" not in cpu.container(f"{FULLNAME}-learner")["resources"]["limits"]


@pytest.mark.parametrize(
    ("image", "learner_image", "expected"),
    [
        ({"tag": "1.2.3"}, {}, "ghcr.io/ratchet/ratchet:1.2.3-cu128"),
        ({}, {"tagSuffix": "-cu126"}, "ghcr.io/ratchet/ratchet:0.1.0-cu126"),
        ({}, {"tag": "mine"}, "ghcr.io/ratchet/ratchet:mine"),
        # image.digest pins the image without torch: the learner never takes it.
        ({"digest": "sha256:" + "a" * 64}, {}, "ghcr.io/ratchet/ratchet:0.1.0-cu128"),
        (
            {},
            {"repository": "r.example.com/l", "digest": "sha256:" + "b" * 64},
            "r.example.com/l@sha256:" + "b" * 64,
        ),
    ],
)
def test_learner_image(
    chart: helm.Chart, image: dict[str, str], learner_image: dict[str, str], expected: str
) -> None:
    values = load_values("defaults")
    r = render(chart, {**values, "image": image, "learner": {"image": learner_image}})
    assert r.container(f"{FULLNAME}-learner")["image"] == expected


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_pods_roll_when_their_config_changes(
    rendered: dict[str, Rendered], values_file: str
) -> None:
    r = rendered[values_file]
    digest = hashlib.sha256(r.files["ratchet/templates/configmap.yaml"].encode()).hexdigest()
    for deployment in r.kinds("Deployment"):
        component = deployment["metadata"]["labels"]["app.kubernetes.io/component"]
        annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
        if component == "vllm":
            continue  # vLLM does not read ratchet.yaml
        if component == "endpoint-picker":  # its own config: test_inference_gateway.py
            assert annotations["checksum/config"] not in (digest, "")
            continue
        assert annotations["checksum/config"] == digest, deployment["metadata"]["name"]


def test_checksum_follows_config_not_unrelated_values(chart: helm.Chart) -> None:
    values = load_values("defaults")

    def checksum(v: dict[str, Any]) -> str:
        proxy = render(chart, v).get("Deployment", f"{FULLNAME}-proxy")
        return proxy["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    before = checksum(values)
    assert checksum({**values, "proxy": {**values["proxy"], "replicaCount": 5}}) == before
    changed = {**values, "aliases": {"support": {"canary": {"weight": 0.2, "min_requests": 5}}}}
    assert checksum(changed) != before


def test_network_policy_lets_only_ratchet_reach_vllm(rendered: dict[str, Rendered]) -> None:
    for values_file in ("defaults", "all-on"):
        r = rendered[values_file]
        policy = r.get("NetworkPolicy", f"{FULLNAME}-vllm")["spec"]
        assert policy["policyTypes"] == ["Ingress"]
        pods = {
            p["metadata"]["labels"]["app.kubernetes.io/component"]: p
            for p in r.pod_templates().values()
        }
        guarded = {c for c, p in pods.items() if _selects(policy["podSelector"], p["metadata"])}
        assert guarded == {"vllm"}
        [rule, *_] = policy["ingress"]
        assert len(policy["ingress"]) == 1
        # The only port open is the one vLLM serves inference (and its admin routes) on.
        vllm = pods["vllm"]["spec"]["containers"][0]
        assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
        assert "http" in _ports(vllm)
        same_namespace = [p for p in rule["from"] if "namespaceSelector" not in p]
        allowed = {
            c
            for c, p in pods.items()
            if any(_selects(peer["podSelector"], p["metadata"]) for peer in same_namespace)
        }
        # The console asks vLLM's /health for its status panel.
        expected = {"proxy", "judge", "learner", "console"} & set(pods)
        assert allowed == expected, values_file
        # The same labels in another release do not get in.
        stranger = {**pods["proxy"]["metadata"]["labels"], "app.kubernetes.io/instance": "other"}
        assert not any(
            _selects(peer["podSelector"], {"labels": stranger}) for peer in same_namespace
        )
    extra = rendered["all-on"].get("NetworkPolicy", f"{FULLNAME}-vllm")["spec"]["ingress"][0]
    assert load_values("all-on")["networkPolicy"]["vllmExtraFrom"][0] in extra["from"]


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_security_contexts(rendered: dict[str, Rendered], values_file: str) -> None:
    r = rendered[values_file]
    for name, pod in r.pod_templates().items():
        spec = pod["spec"]
        if pod["metadata"]["labels"]["app.kubernetes.io/component"] == "endpoint-picker":
            # It watches its InferencePool and pods: its own account, with a token (and a Role
            # for those alone: tests/deploy/test_inference_gateway.py).
            assert spec["serviceAccountName"] == f"{FULLNAME}-endpoint-picker"
        else:
            assert spec["automountServiceAccountToken"] is False, name
            assert spec["serviceAccountName"] == FULLNAME
        assert spec["enableServiceLinks"] is False, name
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        component = pod["metadata"]["labels"]["app.kubernetes.io/component"]
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["capabilities"]["drop"] == ["ALL"], name
            assert c["resources"]["requests"], name
            assert spec["securityContext"]["runAsNonRoot"] is True, name
            assert sc["readOnlyRootFilesystem"] is True, name
            writable = {m["mountPath"] for m in c.get("volumeMounts", []) if not m.get("readOnly")}
            if component == "vllm":
                # The upstream image's own user would be root: another one, whose HOME (the
                # compile caches) and model cache are volumes it may write (audit L-9).
                assert spec["securityContext"]["runAsUser"] not in (0, 10001), name
                assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsUser"]
                env = {e["name"]: e.get("value") for e in c["env"]}
                assert {"/tmp", env["HOME"], env["HF_HOME"], "/dev/shm"} <= writable, name
                continue
            if component == "endpoint-picker":  # the router image's own unprivileged user
                assert spec["securityContext"]["runAsUser"] == 65532 and not writable, name
                continue
            assert spec["securityContext"]["runAsUser"] == 10001, name
            if component != "test":
                assert {"/tmp", "/var/lib/ratchet"} <= writable, name


def test_chart_secret_holds_the_secrets(rendered: dict[str, Rendered]) -> None:
    r = rendered["all-on"]
    data = {
        k: base64.b64decode(v).decode()
        for k, v in r.get("Secret", f"{FULLNAME}-secrets")["data"].items()
    }
    assert data == {
        "api-keys": '["sk-SENTINEL-client-key-1","sk-SENTINEL-client-key-2"]',
        "admin-key": "sk-SENTINEL-admin-key",
        "kafka-sasl-password": "SENTINEL-kafka-password",
        "redis-password": "SENTINEL-redis-password",
    }
    judge = {
        k: base64.b64decode(v).decode()
        for k, v in r.get("Secret", f"{FULLNAME}-judge")["data"].items()
    }
    assert judge == {
        "RATCHET_JUDGE__JUDGE_API_KEY": "sk-SENTINEL-judge",
        "SQL_VERIFIER_DSN": "SENTINEL-verifier-dsn",
    }
    # The judge, and the learner's gate (same judge model and verifiers), read that Secret.
    for component in ("judge", "learner"):
        pod = r.get("Deployment", f"{FULLNAME}-{component}")["spec"]["template"]
        container = pod["spec"]["containers"][0]
        assert container["envFrom"] == [{"secretRef": {"name": f"{FULLNAME}-judge"}}]
        assert "checksum/judge-secret" in pod["metadata"]["annotations"]
        # Neither gets client keys: they are the proxy's alone.
        assert not {"RATCHET_PROXY__API_KEYS", "RATCHET_PROXY__ADMIN_KEY"} & {
            *(e["name"] for e in container["env"]),
            *secret_file_refs(r, f"{FULLNAME}-{component}"),
        }
    # Without a judge key or other judge secrets there is no judge Secret and no envFrom.
    defaults = rendered["defaults"]
    assert not defaults.has("Secret", f"{FULLNAME}-judge")
    assert "envFrom" not in defaults.container(f"{FULLNAME}-judge")
    assert "envFrom" not in defaults.container(f"{FULLNAME}-learner")


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_no_secret_value_outside_secrets(rendered: dict[str, Rendered], values_file: str) -> None:
    r = rendered[values_file]
    for obj in r.objects:
        if obj["kind"] == "Secret":
            continue
        text = repr(obj)
        assert SENTINEL not in text, f"a secret value is in {obj['kind']}/{obj['metadata']['name']}"
    for c in _all_containers(r):
        for env in c.get("env", []):
            if "value" in env:
                assert "PASSWORD" not in env["name"] and "KEY" not in env["name"], env


def test_existing_secrets_are_referenced_not_written(rendered: dict[str, Rendered]) -> None:
    r = rendered["existing-secrets"]
    assert not r.kinds("Secret")
    proxy = r.get("Deployment", f"{FULLNAME}-proxy")["spec"]["template"]
    assert "checksum/secret" not in proxy["metadata"]["annotations"]
    files = secret_file_refs(r, f"{FULLNAME}-proxy")
    keys, admin = "ratchet-proxy-keys", True
    assert files["RATCHET_PROXY__API_KEYS"] == {"name": keys, "key": "keys.json", "optional": False}
    assert files["RATCHET_PROXY__ADMIN_KEY"] == {"name": keys, "key": "admin", "optional": admin}
    assert files["RATCHET_PROXY__USER_VOUCHING_KEYS"] == {
        "name": keys,
        "key": "user-vouching-keys",
        "optional": True,
    }
    # The judge and the learner have Kafka users of their own (kafka.sasl.users).
    kafka_users = {
        "judge": ("ratchet-judge", "ratchet-judge-kafka", "password"),
        "learner": ("ratchet-learner", "ratchet-learner-kafka", "pw"),
    }
    for component in RATCHET_COMPONENTS:
        files = secret_file_refs(r, f"{FULLNAME}-{component}")
        user, secret, key = kafka_users.get(component, ("", "ratchet-kafka-user", "password"))
        assert files["RATCHET_KAFKA__SASL_PASSWORD"] == {
            "name": secret,
            "key": key,
            "optional": False,
        }
        env = container_env(r, f"{FULLNAME}-{component}")
        assert env.get("RATCHET_KAFKA__SASL_USERNAME", "") == user
        assert files["RATCHET_REDIS_PASSWORD"] == {
            "name": "redis-auth",
            "key": "redis-password",
            "optional": False,
        }
    for component in ("judge", "learner"):
        container = r.container(f"{FULLNAME}-{component}")
        assert container["envFrom"] == [{"secretRef": {"name": "ratchet-judge-providers"}}]
    test_pod = r.get("Pod", f"{FULLNAME}-test-proxy")
    keys = next(e for e in test_pod["spec"]["containers"][0]["env"] if e["name"] == "API_KEYS")
    assert keys["valueFrom"]["secretKeyRef"] == {"name": "ratchet-proxy-keys", "key": "keys.json"}


def test_redis_password_is_a_file_and_the_url_keeps_the_user(
    rendered: dict[str, Rendered], clean_ratchet_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = rendered["all-on"]
    url = "rediss://ratchet@my-redis.cache.example.com:6380/2?ssl_ca_certs=/etc/ratchet/redis-ca/ca.crt"
    assert r.config["redis_url"] == url
    for component in RATCHET_COMPONENTS:
        deployment = f"{FULLNAME}-{component}"
        assert container_secret_files(r, deployment)["RATCHET_REDIS_PASSWORD"] == (
            "SENTINEL-redis-password"
        )
        with monkeypatch.context() as pod_env:
            settings = _load_in_pod(r, deployment, clean_ratchet_env, pod_env)
        parsed = parse_url(redis_connection_url(settings))
        assert (parsed["username"], parsed["password"]) == ("ratchet", "SENTINEL-redis-password")
    # Without a password there is no file, and the URL is the ConfigMap's as given.
    r = rendered["existing-vllm"]
    assert "RATCHET_REDIS_PASSWORD" not in secret_file_refs(r, f"{FULLNAME}-proxy")
    assert "@" not in r.config["redis_url"]


def test_tls_ca_secrets_are_mounted_where_the_config_points(
    rendered: dict[str, Rendered],
) -> None:
    r = rendered["all-on"]
    assert r.config["kafka"]["ssl_cafile"] == "/etc/ratchet/kafka-ca/ca.crt"
    pod = r.get("Deployment", f"{FULLNAME}-proxy")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert volumes["kafka-ca"]["secret"]["secretName"] == "my-cluster-cluster-ca-cert"
    assert mounts["kafka-ca"] == "/etc/ratchet/kafka-ca"
    assert volumes["redis-ca"]["secret"]["secretName"] == "redis-ca"
    assert mounts["redis-ca"] == "/etc/ratchet/redis-ca"


def test_judges_and_learners_scale_out_with_budgets(
    chart: helm.Chart, rendered: dict[str, Rendered]
) -> None:
    """Two judges share ratchet.traffic by default; learners scale when asked (each alias is
    leased to one of them), rolled one at a time without a surge, under a budget."""
    defaults = rendered["defaults"]
    judge = defaults.get("Deployment", f"{FULLNAME}-judge")
    assert judge["spec"]["replicas"] == 2
    pdb = defaults.get("PodDisruptionBudget", f"{FULLNAME}-judge")["spec"]
    assert pdb["maxUnavailable"] == 1
    assert _selects(pdb["selector"], judge["spec"]["template"]["metadata"])
    # The judged marks' and the alias lease's lifetimes are the services' own defaults.
    assert "done_ttl_s" not in defaults.config["judge"]
    assert "lease_ttl_s" not in defaults.config["learner"]
    assert not defaults.has("PodDisruptionBudget", f"{FULLNAME}-learner")  # one learner

    values = load_values("defaults")
    two = render(chart, {**values, "learner": {"replicaCount": 2, "config": {"lease_ttl_s": 10}}})
    learner = two.get("Deployment", f"{FULLNAME}-learner")
    assert learner["spec"]["replicas"] == 2
    assert learner["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    pdb = two.get("PodDisruptionBudget", f"{FULLNAME}-learner")["spec"]
    assert _selects(pdb["selector"], learner["spec"]["template"]["metadata"])
    assert two.config["learner"]["lease_ttl_s"] == 10


def test_hpa_pdb_and_service_monitors(rendered: dict[str, Rendered]) -> None:
    r = rendered["all-on"]
    proxy = r.get("Deployment", f"{FULLNAME}-proxy")
    assert "replicas" not in proxy["spec"]  # the HPA owns the replica count
    hpa = r.get("HorizontalPodAutoscaler", f"{FULLNAME}-proxy")["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": f"{FULLNAME}-proxy",
    }
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (3, 12)
    pdb = r.get("PodDisruptionBudget", f"{FULLNAME}-proxy")["spec"]
    assert _selects(pdb["selector"], proxy["spec"]["template"]["metadata"])
    monitors = {m["metadata"]["name"]: m for m in r.kinds("ServiceMonitor")}
    assert set(monitors) == {
        f"{FULLNAME}-{c}" for c in ("proxy", "judge", "learner", "console", "vllm")
    }
    services = r.kinds("Service")
    pods = r.pod_templates()
    for name, monitor in monitors.items():
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        spec = monitor["spec"]
        assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        [svc] = [s for s in services if _selects(spec["selector"], s["metadata"])]
        [endpoint] = spec["endpoints"]
        assert endpoint["path"] == "/metrics"
        [port] = [p for p in svc["spec"]["ports"] if p["name"] == endpoint["port"]]
        # The Service's port leads to the container port the component serves /metrics on.
        [pod] = [p for p in pods.values() if _selects(svc["spec"]["selector"], p["metadata"])]
        served = {n for c in pod["spec"]["containers"] for n in _ports(c)}
        assert port["targetPort"] in served, name
    learner = monitors[f"{FULLNAME}-learner"]["spec"]["endpoints"][0]
    assert learner["port"] == "metrics"
    # Off loopback the proxy's /metrics needs the admin key: Prometheus sends it.
    proxy_endpoint = monitors[f"{FULLNAME}-proxy"]["spec"]["endpoints"][0]
    assert proxy_endpoint["authorization"]["type"] == "Bearer"
    assert proxy_endpoint["authorization"]["credentials"]["key"] == "admin-key"
    assert "authorization" not in learner
    # The console serves /metrics on the port its pages are on.
    console = monitors[f"{FULLNAME}-console"]["spec"]["endpoints"][0]
    assert console["port"] == "http"


def test_helm_test_hook_calls_readyz_and_models(rendered: dict[str, Rendered]) -> None:
    pod = rendered["defaults"].get("Pod", f"{FULLNAME}-test-proxy")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    [c] = pod["spec"]["containers"]
    script = c["command"][-1]
    assert '"/readyz"' in script and '"/v1/models"' in script
    env = {e["name"]: e for e in c["env"]}
    assert env["PROXY_URL"]["value"] == f"http://{FULLNAME}-proxy:8400"
    compile(script, "helm-test", "exec")  # the script at least parses


def test_notes_explain_kafka_and_redis(rendered: dict[str, Rendered]) -> None:
    notes = rendered["defaults"].files["ratchet/templates/NOTES.txt"]
    assert "Strimzi" in notes and "kafka.sasl.existingSecret" in notes
    assert "helm test prod" in notes


# ---- the web console -------------------------------------------------------------------------

CONSOLE = f"{FULLNAME}-console"
CONSOLE_NAMES = [
    CONSOLE,
    *(f"{CONSOLE}.{NAMESPACE}{tail}" for tail in ("", ".svc", ".svc.cluster.local")),
]
CONSOLE_ADMIN_KEY = "sk-SENTINEL-console-admin"


def _with_console(**console: Any) -> dict[str, Any]:
    """The defaults with the console on and the admin key it needs."""
    values = load_values("defaults")
    return {
        **values,
        "proxy": {**values["proxy"], "adminKey": CONSOLE_ADMIN_KEY},
        "console": {"enabled": True, **console},
    }


def test_console_is_off_by_default(chart: helm.Chart, rendered: dict[str, Rendered]) -> None:
    assert chart.values["console"]["enabled"] is False
    for values_file in ("defaults", "existing-vllm", "gpu-learner"):
        r = rendered[values_file]
        assert not [n for n in r.names() if "console" in n], values_file
        assert "console" not in r.config, values_file
        assert "console" not in _component_pods(r), values_file


def test_console_deployment_and_service(rendered: dict[str, Rendered]) -> None:
    r = rendered["all-on"]
    deployment = r.get("Deployment", CONSOLE)
    assert deployment["spec"]["replicas"] == 1
    pod = deployment["spec"]["template"]
    [console] = pod["spec"]["containers"]
    judge = r.container(f"{FULLNAME}-judge")
    # The judge's image and the way every service gets ratchet.yaml.
    assert console["command"] == ["ratchet", "console", "--config", "/etc/ratchet/ratchet.yaml"]
    assert console["image"] == judge["image"]
    assert _ports(console) == {"http": 8404}
    for probe in ("livenessProbe", "readinessProbe"):
        assert _probe(console, probe) == ("/healthz", "http")
    annotations = pod["metadata"]["annotations"]
    digest = hashlib.sha256(r.files["ratchet/templates/configmap.yaml"].encode()).hexdigest()
    assert annotations["checksum/config"] == digest
    # Its admin key is in the chart's Secret: the console rolls when it changes.
    assert "checksum/secret" in annotations and "checksum/server-secret" in annotations
    # It listens on the pod network, on the port of its probes and its Service.
    assert r.config["console"] == {
        "host": "0.0.0.0",
        "port": 8404,
        "refresh_s": 2.5,
        "proxy_url": f"http://{FULLNAME}-proxy:8400",
        # Counters from every replica, through headless Services (their names resolve to each
        # ready pod) on the ports the proxy and the judge serve /metrics on.
        "proxy_metrics_url": f"http://{FULLNAME}-proxy-replicas:8400",
        "judge_metrics_url": f"http://{FULLNAME}-judge-replicas:8402",
        "allowed_hosts": CONSOLE_NAMES,  # its Service's, never any (tests/deploy/test_egress.py)
    }
    for component, port in (("proxy", "http"), ("judge", "metrics")):
        service = r.get("Service", f"{FULLNAME}-{component}-replicas")["spec"]
        assert service["clusterIP"] == "None"
        assert (
            service["selector"] == r.get("Service", f"{FULLNAME}-{component}")["spec"]["selector"]
        )
        assert [p["targetPort"] for p in service["ports"]] == [port]

    env = {e["name"]: e for e in console["env"]}
    assert {e["name"] for e in judge["env"]} <= set(env)
    # The judge's secret files, but for vLLM's key (the console reads only the open /health),
    # and with the admin key.
    files = secret_file_refs(r, CONSOLE)
    judge_files = secret_file_refs(r, f"{FULLNAME}-judge")
    assert set(judge_files) - {"RATCHET_VLLM_API_KEY"} <= set(files)
    assert "RATCHET_VLLM_API_KEY" not in files
    assert files["RATCHET_PROXY__ADMIN_KEY"] == {
        "name": f"{FULLNAME}-secrets",
        "key": "admin-key",
        "optional": False,
    }
    # Client keys are the proxy's, the judge model's keys the judge's.
    assert "RATCHET_PROXY__API_KEYS" not in files
    assert "envFrom" not in console

    # The judge's mounts (ratchet.yaml, state, Kafka and Redis CAs), and the adapter store
    # read-only on the claim the learner writes.
    mounts = {m["name"]: m for m in console["volumeMounts"]}
    judge_mounts = {m["name"]: m for m in judge["volumeMounts"]}
    assert judge_mounts.items() <= mounts.items()
    assert mounts["adapters"] == {
        "name": "adapters",
        "mountPath": r.config["store_dir"],
        "readOnly": True,
    }
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    learner_pod = r.get("Deployment", f"{FULLNAME}-learner")["spec"]["template"]["spec"]
    learner_claim = {v["name"]: v for v in learner_pod["volumes"]}["adapters"]
    assert volumes["adapters"]["persistentVolumeClaim"] == {
        **learner_claim["persistentVolumeClaim"],
        "readOnly": True,
    }
    assert console["resources"] == {
        "requests": {"cpu": "100m", "memory": "256Mi"},
        "limits": {"memory": "512Mi"},
    }

    service = r.get("Service", CONSOLE)
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8404, "targetPort": "http", "protocol": "TCP"}
    ]
    assert service["metadata"]["annotations"] == {"example.com/owner": "ml-platform"}
    selected = [
        name
        for name, p in r.pod_templates().items()
        if _selects(service["spec"]["selector"], p["metadata"])
    ]
    assert selected == [CONSOLE]


def test_console_port_and_settings_follow_the_values(chart: helm.Chart) -> None:
    r = render(
        chart,
        _with_console(port=9404, replicaCount=2, config={"refresh_s": 5}, service={"port": 80}),
    )
    assert r.config["console"] == {
        "host": "0.0.0.0",
        "port": 9404,
        "refresh_s": 5,
        # The health panel reaches the proxy through its Service, not the console's own pod.
        "proxy_url": f"http://{FULLNAME}-proxy:8400",
        "proxy_metrics_url": f"http://{FULLNAME}-proxy-replicas:8400",
        "judge_metrics_url": f"http://{FULLNAME}-judge-replicas:8402",
        "allowed_hosts": CONSOLE_NAMES,
    }
    assert r.get("Deployment", CONSOLE)["spec"]["replicas"] == 2
    assert _ports(r.container(CONSOLE)) == {"http": 9404}
    [port] = r.get("Service", CONSOLE)["spec"]["ports"]
    assert (port["port"], port["targetPort"]) == (80, "http")


@pytest.mark.parametrize(
    ("values_file", "admin_key"),
    [("all-on", "sk-SENTINEL-admin-key"), ("existing-secrets", "sk-SENTINEL-op-admin")],
)
def test_console_starts_with_the_admin_key(
    rendered: dict[str, Rendered],
    values_file: str,
    admin_key: str,
    clean_ratchet_env: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The console's pod loads its settings: on 0.0.0.0 with the proxy's admin key, which the
    console checks before it listens, and the same Redis and Kafka as the judge."""
    r = rendered[values_file]
    env = container_inputs(r, CONSOLE)
    # The proxy's Kafka user where there is a proxy (the judge may have its own).
    peer = f"{FULLNAME}-proxy" if r.has("Deployment", f"{FULLNAME}-proxy") else f"{FULLNAME}-judge"
    peer_env = container_inputs(r, peer)
    for name in ("RATCHET_REDIS_PASSWORD", "RATCHET_KAFKA__SASL_PASSWORD", "RATCHET_SECRET"):
        assert env.get(name) == peer_env.get(name), name
    settings = _load_in_pod(r, CONSOLE, clean_ratchet_env, monkeypatch)
    assert (settings.console.host, settings.console.port) == ("0.0.0.0", 8404)
    assert settings.proxy.admin_key is not None
    assert settings.proxy.admin_key.get_secret_value() == admin_key
    settings.check_console_exposure()
    assert settings.store_dir == Path(r.config["store_dir"])
    assert settings.kafka_bootstrap_servers == r.config["kafka_bootstrap_servers"]
    if values_file == "existing-secrets":
        admin = secret_file_refs(r, CONSOLE)["RATCHET_PROXY__ADMIN_KEY"]
        # Not optional: a Secret without the key stops the pod with an event that names it.
        assert admin == {"name": "ratchet-proxy-keys", "key": "admin", "optional": False}


def test_console_without_an_admin_key_is_refused(chart: helm.Chart) -> None:
    values = load_values("defaults")
    with pytest.raises(helm.HelmRenderError) as exc:
        render(chart, {**values, "console": {"enabled": True}})
    message = str(exc.value)
    assert "console.enabled is true but proxy.adminKey is empty" in message
    assert "Set proxy.adminKey" in message and "proxy.existingSecret" in message
    # The proxy's admin key is optional while the console is off.
    assert render(chart, {**values, "console": {"enabled": False}}).objects


def test_console_without_the_proxy_still_gets_the_admin_key(chart: helm.Chart) -> None:
    r = render(
        chart, {**_with_console(), "proxy": {"enabled": False, "adminKey": CONSOLE_ADMIN_KEY}}
    )
    assert not r.has("Deployment", f"{FULLNAME}-proxy")
    data = {
        k: base64.b64decode(v).decode()
        for k, v in r.get("Secret", f"{FULLNAME}-secrets")["data"].items()
    }
    # The proxy's keys are not written without a proxy; the backends' passwords still are.
    assert data == {
        "admin-key": CONSOLE_ADMIN_KEY,
        "kafka-sasl-password": "SENTINEL-kafka-password",
        "redis-password": "SENTINEL-redis-password",
    }
    assert secret_file_refs(r, CONSOLE)["RATCHET_PROXY__ADMIN_KEY"] == {
        "name": f"{FULLNAME}-secrets",
        "key": "admin-key",
        "optional": False,
    }


def test_console_reads_the_adapter_store_of_an_existing_vllm(chart: helm.Chart) -> None:
    values = _with_console()
    r = render(
        chart,
        {
            **values,
            "vllm": {"enabled": False, "url": "http://vllm.inference:8000"},
            "adapters": {"existingClaim": "vllm-adapters"},
        },
    )
    assert not r.kinds("PersistentVolumeClaim")
    pod = r.get("Deployment", CONSOLE)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["adapters"]["persistentVolumeClaim"] == {
        "claimName": "vllm-adapters",
        "readOnly": True,
    }


def test_console_network_policy(chart: helm.Chart, rendered: dict[str, Rendered]) -> None:
    r = rendered["all-on"]
    policy = r.get("NetworkPolicy", CONSOLE)["spec"]
    pods = _component_pods(r)
    guarded = {c for c, p in pods.items() if _selects(policy["podSelector"], p["metadata"])}
    assert guarded == {"console"}
    assert policy["policyTypes"] == ["Ingress"]
    # Only its port, from the peers the values name.
    [rule] = policy["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert "http" in _ports(r.container(CONSOLE))
    assert rule["from"] == load_values("all-on")["networkPolicy"]["consoleFrom"]
    # Without consoleFrom any peer reaches that port, and only it.
    open_ = render(chart, _with_console()).get("NetworkPolicy", CONSOLE)["spec"]
    assert open_["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}]}]
    # vLLM's policy lets the console in (for /health) only while it runs.
    defaults = rendered["defaults"].get("NetworkPolicy", f"{FULLNAME}-vllm")["spec"]
    [peer] = [p for p in defaults["ingress"][0]["from"] if "namespaceSelector" not in p]
    assert not _selects(peer["podSelector"], pods["console"]["metadata"])
    off = render(chart, {**_with_console(), "networkPolicy": {"enabled": False}})
    assert not off.kinds("NetworkPolicy")


METRICS_POLICY = f"{FULLNAME}-metrics"


def test_metrics_network_policy(chart: helm.Chart, rendered: dict[str, Rendered]) -> None:
    """Audit L-8: the judge's and learner's metrics listen on 0.0.0.0; their pods take connections
    on that port only, from networkPolicy.metricsFrom, and from no peer without it."""
    for values_file in ("defaults", "all-on"):
        r = rendered[values_file]
        policy = r.get("NetworkPolicy", METRICS_POLICY)["spec"]
        pods = _component_pods(r)
        guarded = {c for c, p in pods.items() if _selects(policy["podSelector"], p["metadata"])}
        assert guarded == {"judge", "learner"}, values_file
        assert policy["policyTypes"] == ["Ingress"]
        for component in guarded:  # their only port: nothing else is reachable either
            assert set(_ports(pods[component]["spec"]["containers"][0])) == {"metrics"}
        stranger = {**pods["judge"]["metadata"]["labels"], "app.kubernetes.io/instance": "other"}
        assert not _selects(policy["podSelector"], {"labels": stranger})
    assert rendered["defaults"].get("NetworkPolicy", METRICS_POLICY)["spec"]["ingress"] == []
    # all-on runs the console: Prometheus, and the console (for the judge's counters).
    rule, console = rendered["all-on"].get("NetworkPolicy", METRICS_POLICY)["spec"]["ingress"]
    assert rule["ports"] == console["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert rule["from"] == load_values("all-on")["networkPolicy"]["metricsFrom"]
    [peer] = console["from"]
    console_pod = _component_pods(rendered["all-on"])["console"]["metadata"]
    assert _selects(peer["podSelector"], console_pod)
    assert not _selects(
        peer["podSelector"], _component_pods(rendered["all-on"])["proxy"]["metadata"]
    )
    # Guards only what runs.
    values = load_values("defaults")
    judge_only = render(chart, {**values, "learner": {"enabled": False}})
    policy = judge_only.get("NetworkPolicy", METRICS_POLICY)["spec"]
    assert policy["podSelector"]["matchExpressions"][0]["values"] == ["judge"]
    off = {"enabled": False}
    neither = render(chart, {**values, "judge": {**off, "apiKey": "x"}, "learner": off})
    assert not neither.has("NetworkPolicy", METRICS_POLICY)
    assert not render(chart, {**values, "networkPolicy": off}).kinds("NetworkPolicy")
    # A ServiceMonitor that Prometheus could never scrape through is refused, naming the fix.
    with pytest.raises(helm.HelmRenderError) as exc:
        render(chart, {**values, "serviceMonitor": {"enabled": True}})
    assert "networkPolicy.metricsFrom is empty" in str(exc.value)
    scraped = render(chart, {**values, "serviceMonitor": {"enabled": True}, "networkPolicy": off})
    assert scraped.kinds("ServiceMonitor")


def test_console_values_mirror_its_settings(chart: helm.Chart) -> None:
    """console.config has exactly ConsoleSettings' fields less host, port and the services' URLs
    (which the chart sets), with the same bounds, and the chart's console.port is the console's
    default (what values.yaml sets under console.config: test_config's CHART_DECISIONS)."""
    schema = chart.schema
    assert schema is not None
    console = schema["properties"]["console"]
    assert console["additionalProperties"] is False
    config = console["properties"]["config"]
    assert config["additionalProperties"] is False
    fields = ratchet_settings.ConsoleSettings.model_fields
    chart_set = {"host", "port", "proxy_url", "proxy_metrics_url", "judge_metrics_url"}
    assert set(config["properties"]) == set(fields) - chart_set
    for name in config["properties"]:
        _same_bounds(config["properties"][name], fields[name], f"console.{name}")
    _same_bounds(console["properties"]["port"], fields["port"], "console.port")
    defaults = ratchet_settings.ConsoleSettings().model_dump(mode="json")
    assert chart.values["console"]["port"] == defaults["port"]


@pytest.mark.parametrize(
    ("console", "expected"),
    [
        ({"config": {"host": "127.0.0.1"}}, "additional properties 'host' not allowed"),
        ({"config": {"refresh_s": 0}}, "exclusiveMinimum"),
        ({"port": 70000}, "maximum"),
        ({"replicas": 2}, "additional properties 'replicas' not allowed"),
    ],
)
def test_schema_refuses_bad_console_values(
    chart: helm.Chart, console: dict[str, Any], expected: str
) -> None:
    with pytest.raises(helm.HelmValuesError) as exc:
        render(chart, _with_console(**console))
    message = str(exc.value)
    assert "/console" in message and expected in message, message


# ---- helpers ---------------------------------------------------------------------------------


def _ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def _probe(container: dict[str, Any], kind: str) -> tuple[str, str]:
    get = container[kind]["httpGet"]
    return get["path"], get["port"]


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _component_pods(r: Rendered) -> dict[str, dict[str, Any]]:
    return {
        p["metadata"]["labels"]["app.kubernetes.io/component"]: p
        for p in r.pod_templates().values()
    }


def _all_containers(r: Rendered) -> list[dict[str, Any]]:
    return [c for pod in r.pod_templates().values() for c in pod["spec"]["containers"]]


def _selects(selector: dict[str, Any], metadata_or_labels: dict[str, Any]) -> bool:
    """Kubernetes label-selector semantics (matchLabels + matchExpressions, or a plain map)."""
    labels = metadata_or_labels.get("labels", metadata_or_labels)
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def test_kafka_users_without_sasl_are_refused(chart: helm.Chart) -> None:
    values = load_values("existing-vllm")  # allowInsecure, PLAINTEXT
    users = {"judge": {"username": "ratchet-judge", "existingSecret": "ratchet-judge"}}
    with pytest.raises(helm.HelmRenderError, match=r"kafka.sasl.users is set but"):
        render(chart, {**values, "kafka": {**values["kafka"], "sasl": {"users": users}}})


def test_the_kafka_acl_table_is_what_the_services_write_and_read() -> None:
    """The chart README's per-user ACLs grant each component exactly the topics that
    docs/architecture.md says it writes and, for the judge and learner, reads: an ACL too narrow
    stops a service, one too wide lets it forge what another writes."""
    from tests.unit.ratchet.test_architecture_doc import section, table_rows

    def components(cell: str) -> set[str]:
        return {c for c in ("proxy", "judge", "learner", "console") if re.search(rf"\b{c}\b", cell)}

    doc = (ROOT / "docs" / "architecture.md").read_text()
    writes: dict[str, set[str]] = {c: set() for c in ("proxy", "judge", "learner", "console")}
    reads = {c: set() for c in writes}
    for topic, _key, _record, written_by, read_by in table_rows(section(doc, "Kafka topics")):
        name = topic.strip("`")
        for component in components(written_by):
            writes[component].add(name)
        for component in components(read_by.split("people")[0]):
            reads[component].add(name)
    readme = (CHART / "README.md").read_text()
    acls = readme.split("### Kafka users and ACLs")[1].split("\n## ")[0]
    for user, write, read, _groups in table_rows(acls):
        assert set(re.findall(r"`([\w.]+)`", write)) == writes[user], user
        assert set(re.findall(r"`([\w.]+)`", read)) == reads[user], user


def test_several_vllm_replicas_are_reached_one_by_one_through_a_headless_service(
    rendered: dict[str, Rendered],
) -> None:
    """Two vLLM replicas: a headless Service lists each pod, and the proxy, judge and gate
    balance across its addresses (vllm_endpoints); one replica needs neither."""
    r = rendered["all-on"]
    headless = r.get("Service", f"{FULLNAME}-vllm-replicas")["spec"]
    deployment = r.get("Deployment", f"{FULLNAME}-vllm")
    assert headless["clusterIP"] == "None"
    assert headless["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert deployment["spec"]["replicas"] == 2
    assert r.config["vllm_endpoints"] == [f"http://{FULLNAME}-vllm-replicas:8000"]
    assert r.config["vllm_url"] == f"http://{FULLNAME}-vllm:8000"  # the judge model's address
    one = rendered["defaults"]
    assert "vllm_endpoints" not in one.config
    assert not one.has("Service", f"{FULLNAME}-vllm-replicas")
