"""The chart README's recipe for running `ratchet export` as a Job, run as written: its jq
program (through libjq's Python binding) turns the rendered learner Deployment into a Job that
Kubernetes' schema accepts and that has what the export needs and nothing of the learner's
place in the cluster."""

from __future__ import annotations

from typing import Any

import jq
import kubernetes_validate
import pytest

from tests.deploy.conftest import CHART, FULLNAME, Rendered
from tests.deploy.test_chart import KUBE_VERSIONS


def readme_program() -> str:
    """The jq program of the README's "Exporting data as a Job" block."""
    section = (CHART / "README.md").read_text().split("### Exporting data as a Job", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return block.split("jq '", 1)[1].split("' \\", 1)[0]


def export_job(r: Rendered) -> dict[str, Any]:
    deployment = r.get("Deployment", f"{FULLNAME}-learner")
    job: dict[str, Any] = jq.compile(readme_program()).input_value(deployment).first()
    return job


@pytest.mark.parametrize("values_file", ["defaults", "existing-secrets", "gpu-learner"])
def test_the_readmes_export_job_runs_the_export_with_the_learners_config_and_secrets(
    rendered: dict[str, Rendered], values_file: str
) -> None:
    r = rendered[values_file]
    job = export_job(r)
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(job, version, strict=True)
    pod = job["spec"]["template"]
    [container] = pod["spec"]["containers"]
    learner = r.container(f"{FULLNAME}-learner")
    assert container["command"][:3] == ["ratchet", "export", "support"]
    assert container["image"] == learner["image"]
    # What the export reads: ratchet.yaml, the secret files, the Kafka user; where it writes.
    assert container["env"] == learner["env"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/etc/ratchet", "/var/run/secrets/ratchet", "/exports"} <= mounts
    assert "resources" not in container and "ports" not in container  # no GPU held
    assert pod["spec"]["restartPolicy"] == "OnFailure"
    # Not one of the learner's pods: its Service, PodDisruptionBudget and Deployment ignore it.
    selector = r.get("Deployment", f"{FULLNAME}-learner")["spec"]["selector"]["matchLabels"]
    assert not set(selector.items()) <= set(pod["metadata"]["labels"].items())
