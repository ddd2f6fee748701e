"""Render the Helm chart offline (Helm v4 SDK) and hand the manifests to the tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "ratchet"
VALUES = Path(__file__).parent / "values"
RELEASE = "prod"
NAMESPACE = "ml"
FULLNAME = "prod-ratchet"
VALUES_FILES = sorted(p.stem for p in VALUES.glob("*.yaml"))


@dataclass
class Rendered:
    """One rendering of the chart: the raw files and the parsed objects by kind and name."""

    files: dict[str, str]
    objects: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for path, text in self.files.items():
            if not path.endswith(".yaml"):
                continue
            self.objects += [doc for doc in yaml.safe_load_all(text) if doc]

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.kinds(kind) if o["metadata"]["name"] == name]
        assert found, f"no {kind} {name}; have {sorted(self.names())}"
        return found[0]

    def has(self, kind: str, name: str) -> bool:
        return any(o["metadata"]["name"] == name for o in self.kinds(kind))

    def names(self) -> set[str]:
        return {f"{o['kind']}/{o['metadata']['name']}" for o in self.objects}

    def pod_templates(self) -> dict[str, dict[str, Any]]:
        """Pod specs (with their metadata) of every workload, by the object's name."""
        pods = {o["metadata"]["name"]: o["spec"]["template"] for o in self.kinds("Deployment")}
        for pod in self.kinds("Pod"):
            pods[pod["metadata"]["name"]] = pod
        return pods

    def container(self, deployment: str, name: str | None = None) -> dict[str, Any]:
        spec = self.get("Deployment", deployment)["spec"]["template"]["spec"]
        containers = spec["containers"]
        return next(c for c in containers if name is None or c["name"] == name)

    @property
    def ratchet_yaml(self) -> str:
        return self.get("ConfigMap", f"{FULLNAME}-config")["data"]["ratchet.yaml"]

    @property
    def config(self) -> dict[str, Any]:
        return yaml.safe_load(self.ratchet_yaml)


def load_values(name: str) -> dict[str, Any]:
    return yaml.safe_load((VALUES / f"{name}.yaml").read_text())


@pytest.fixture(scope="session")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: helm.Chart, values: dict[str, Any]) -> Rendered:
    return Rendered(chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True))


@pytest.fixture(scope="session")
def rendered(chart: helm.Chart) -> dict[str, Rendered]:
    return {name: render(chart, load_values(name)) for name in VALUES_FILES}


@pytest.fixture
def clean_ratchet_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No RATCHET_* variable of the developer's shell leaks into settings under test."""
    for name in list(os.environ):
        if name.upper().startswith("RATCHET_"):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path
