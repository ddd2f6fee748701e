"""The server secret and vLLM's API key in the chart: one Secret (generated, or the operator's),
vLLM requires the key on every route, every component that calls vLLM gets it, and neither value
is ever in a ConfigMap, an argument or a plain env value."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from ratchet.secrets import server_secret, vllm_api_key
from tests.deploy.conftest import (
    CHART,
    FULLNAME,
    ROOT,
    VALUES_FILES,
    Rendered,
    load_values,
    render,
)
from tests.deploy.test_config import (
    _load_in_pod,
    _secret_values,
    container_env,
    container_inputs,
    secret_file_refs,
)

GUARD_FILE = CHART / "files" / "ratchet_vllm_guard.py"
GUARD_MODULE = ROOT / "embedded" / "vllm_guard.py"
# Every component that calls vLLM: the proxy forwards, the judge samples and judges, the
# learner's gate answers held-out prompts and judges them.
VLLM_CLIENTS = ("proxy", "judge", "learner")


def _vllm(r: Rendered) -> dict[str, Any]:
    return r.container(f"{FULLNAME}-vllm")


def _secret_data(r: Rendered, name: str) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in r.get("Secret", name)["data"].items()}


def _clients(r: Rendered) -> list[str]:
    return [c for c in VLLM_CLIENTS if r.has("Deployment", f"{FULLNAME}-{c}")]


def test_the_chart_writes_a_kept_random_server_secret(rendered: dict[str, Rendered]) -> None:
    r = rendered["defaults"]
    secret = r.get("Secret", f"{FULLNAME}-server")
    # Uninstall keeps it, so a reinstall reads it back and stored hashes keep their meaning.
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    data = _secret_data(r, f"{FULLNAME}-server")
    assert set(data) == {"ratchet-secret", "vllm-api-key"}
    assert re.fullmatch(r"[A-Za-z0-9]{64}", data["ratchet-secret"])
    assert re.fullmatch(r"[A-Za-z0-9]{48}", data["vllm-api-key"])
    # Drawn at random, not derived from anything a reader of the chart knows.
    other = _secret_data(rendered["all-on"], f"{FULLNAME}-server")
    assert other["ratchet-secret"] != data["ratchet-secret"]
    assert other["vllm-api-key"] != data["vllm-api-key"]


@pytest.mark.parametrize("values_file", ["defaults", "all-on"])
def test_pods_roll_when_the_server_secret_changes(
    rendered: dict[str, Rendered], values_file: str
) -> None:
    """Every pod that reads the chart's server Secret carries the checksum of its data, the same
    one (drawn once per render), so changed values roll vLLM and the services together."""
    r = rendered[values_file]
    data = r.get("Secret", f"{FULLNAME}-server")["data"]
    expected = hashlib.sha256(
        json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
    ).hexdigest()
    for component in ("vllm", *_clients(r)):
        annotations = r.get("Deployment", f"{FULLNAME}-{component}")["spec"]["template"][
            "metadata"
        ]["annotations"]
        assert annotations["checksum/server-secret"] == expected, component


def test_an_existing_secret_is_referenced_not_written(rendered: dict[str, Rendered]) -> None:
    r = rendered["existing-secrets"]
    assert not r.has("Secret", f"{FULLNAME}-server")
    ref = {"name": "ratchet-server"}
    vllm_env = {e["name"]: e for e in _vllm(r)["env"]}
    assert vllm_env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {**ref, "key": "vllm-key"}
    for component in _clients(r):
        files = secret_file_refs(r, f"{FULLNAME}-{component}")
        assert files["RATCHET_SECRET"] == {**ref, "key": "secret", "optional": False}
        assert files["RATCHET_VLLM_API_KEY"] == {**ref, "key": "vllm-key", "optional": False}
        pod = r.get("Deployment", f"{FULLNAME}-{component}")["spec"]["template"]
        # The chart cannot see an operator's Secret, so it has no checksum of it.
        assert "checksum/server-secret" not in pod["metadata"].get("annotations", {})


def test_vllm_requires_its_key_on_every_route(rendered: dict[str, Rendered]) -> None:
    r = rendered["defaults"]
    vllm = _vllm(r)
    args = vllm["args"]
    # The key arrives as vLLM's own variable, so it is not in the pod's command line.
    assert not any(a.startswith("--api-key") for a in args)
    env = {e["name"]: e for e in vllm["env"]}
    assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": f"{FULLNAME}-server",
        "key": "vllm-api-key",
    }
    # --api-key guards /v1 only; the guard puts SageMaker's /adapters and the rest behind it.
    assert args[args.index("--middleware") + 1] == "ratchet_vllm_guard.RequireApiKey"
    module_dir = env["PYTHONPATH"]["value"]
    mounts = {m["name"]: m for m in vllm["volumeMounts"]}
    assert mounts["vllm-guard"] == {
        "name": "vllm-guard",
        "mountPath": module_dir,
        "readOnly": True,
    }
    pod = r.get("Deployment", f"{FULLNAME}-vllm")["spec"]["template"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    configmap = r.get("ConfigMap", volumes["vllm-guard"]["configMap"]["name"])
    assert configmap["data"] == {"ratchet_vllm_guard.py": GUARD_FILE.read_text()}
    digest = hashlib.sha256(GUARD_FILE.read_bytes()).hexdigest()
    assert pod["metadata"]["annotations"]["checksum/vllm-guard"] == digest
    # Probes still need no key: the guard leaves /health open.
    assert vllm["readinessProbe"]["httpGet"]["path"] == "/health"


def test_the_chart_mounts_the_guard_the_embedded_stack_runs() -> None:
    """One guard: the chart's copy (for the upstream image, without Ratchet) is the module."""
    assert GUARD_FILE.read_bytes() == GUARD_MODULE.read_bytes()


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_every_component_that_calls_vllm_gets_its_key(
    rendered: dict[str, Rendered],
    values_file: str,
    clean_ratchet_env: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    r = rendered[values_file]
    keys, secrets = set(), set()
    for component in _clients(r):
        env = container_inputs(r, f"{FULLNAME}-{component}")
        keys.add(env["RATCHET_VLLM_API_KEY"])
        secrets.add(env["RATCHET_SECRET"])
        # As the service loads its settings in the pod: it sends exactly that key.
        with monkeypatch.context() as pod_env:
            settings = _load_in_pod(r, f"{FULLNAME}-{component}", clean_ratchet_env, pod_env)
            assert vllm_api_key(settings) == env["RATCHET_VLLM_API_KEY"]
            assert server_secret(settings) == env["RATCHET_SECRET"].encode()
    assert _clients(r), values_file
    # One key and one secret, shared by every component (and every replica).
    assert len(keys) == 1 and len(secrets) == 1
    if r.has("Deployment", f"{FULLNAME}-vllm"):
        assert container_env(r, f"{FULLNAME}-vllm")["VLLM_API_KEY"] in keys
    # The console reads only vLLM's /health, open without the key: it does not get it (L-6).
    if r.has("Deployment", f"{FULLNAME}-console"):
        assert "RATCHET_VLLM_API_KEY" not in container_inputs(r, f"{FULLNAME}-console")
    # The helm test pod calls the proxy only: it gets neither.
    test_pod = r.get("Pod", f"{FULLNAME}-test-proxy")["spec"]["containers"][0]
    assert not {"RATCHET_VLLM_API_KEY", "RATCHET_SECRET", "VLLM_API_KEY"} & {
        e["name"] for e in test_pod["env"]
    }


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_the_key_and_the_secret_are_never_in_a_configmap(
    rendered: dict[str, Rendered], values_file: str
) -> None:
    r = rendered[values_file]
    client = _clients(r)[0]
    env = container_inputs(r, f"{FULLNAME}-{client}")
    values = [env["RATCHET_VLLM_API_KEY"], env["RATCHET_SECRET"]]
    for obj in r.objects:
        if obj["kind"] == "Secret":
            continue
        text = json.dumps(obj)
        for value in values:
            assert value not in text, (
                f"a secret value is in {obj['kind']}/{obj['metadata']['name']}"
            )
    # Nor is there a setting for them in ratchet.yaml to fill in.
    assert not {"secret", "vllm_api_key"} & set(r.config)


def test_no_secret_at_all_is_refused(chart: helm.Chart) -> None:
    values = {**load_values("defaults"), "secret": {"create": False}}
    with pytest.raises(
        helm.HelmRenderError, match=r"secret\.create is false and secret\.existingSecret is empty"
    ):
        render(chart, values)


# Read from the environment by a third-party library, not by Ratchet's settings: Hugging Face's
# token. (The judge's provider keys arrive by envFrom for the same reason: litellm reads them.)
THIRD_PARTY_SECRET_VARIABLES = {"HF_TOKEN"}


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_no_service_has_a_secret_in_its_environment(
    rendered: dict[str, Rendered], values_file: str
) -> None:
    """Secrets are files (audit L-6): a child process, a crash report or `kubectl describe`
    sees a service's environment, and it holds no secret value or reference."""
    r = rendered[values_file]
    secret_values = {
        value
        for data in _secret_values(r).values()
        for name, value in data.items()
        if len(value) >= 8 and name != "RATCHET_JUDGE__JUDGE_API_KEY"
    }
    for component in ("proxy", "judge", "learner", "console"):
        if not r.has("Deployment", f"{FULLNAME}-{component}"):
            continue
        for var in r.container(f"{FULLNAME}-{component}")["env"]:
            if "valueFrom" in var:
                assert var["name"] in THIRD_PARTY_SECRET_VARIABLES, (component, var["name"])
            else:
                assert not [v for v in secret_values if v in var["value"]], (component, var)
        # ...and every secret it needs is a file in the folder its settings read.
        assert "RATCHET_SECRET" in secret_file_refs(r, f"{FULLNAME}-{component}")
