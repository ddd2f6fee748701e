"""Build the image and run it as the chart does, against the embedded stack's Kafka, Redis and vLLM.

    .venv/bin/python ops/check_image.py             # build (ops/build-image.sh), then check
    .venv/bin/python ops/check_image.py --skip-build
    .venv/bin/python ops/check_image.py --no-learner # proxy and judge only (no torch image)

Kafka (Tansu), Redis and vLLM run on the host on free ports (embedded, as `ratchet up` starts
them); the proxy, judge and learner run as podman containers on the host network, configured as
the chart configures its pods: a ratchet.yaml mounted read-only at /etc/ratchet, the server
secret and vLLM's key in the environment, user 10001, a read-only root filesystem with writable
/tmp and /var/lib/ratchet (the learner also /adapters, /models-cache and /dev/shm), no
capabilities, no privilege escalation, the runtime's default seccomp profile.

It prints each check and exits 1 if one fails; containers, processes and files it made go at exit.
Needs root (podman's default storage; the state folders are chowned to the image's user).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import yaml

from embedded.model import prepare_model
from embedded.processes import Stack, free_port, wait_until
from embedded.stack import create_topics, embedded_stack
from ratchet.bus import make_consumer
from ratchet.records import TRAFFIC_TOPIC, TrafficRecord, decode
from ratchet.secrets import vllm_api_key
from ratchet.settings import default_home, load_settings

ROOT = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
ALIAS = "support"
BASE_MODEL = "smollm2-135m-instruct"
# What the chart's pods run as: podSecurityContext and securityContext of its values.
CHART = yaml.safe_load((ROOT / "helm" / "ratchet" / "values.yaml").read_text())
UID = int(CHART["podSecurityContext"]["runAsUser"])
GID = int(CHART["podSecurityContext"]["runAsGroup"])
READ_ONLY = bool(CHART["securityContext"]["readOnlyRootFilesystem"])
API_KEY = "sk-check-image"
NAME = f"ratchet-check-{os.getpid()}"


def podman_run_flags() -> list[str]:
    """What podman needs on this kind of machine to start a container at all.

    runc, not Debian's default crun: crun 1.8 refuses cgroups in hybrid mode (v1 controllers,
    with hugetlb left on the v2 hierarchy). Explicit rlimits: podman asks for nofile 1048576 and
    the host's nproc, above what its own processes hold here, and this VM grants no
    CAP_SYS_RESOURCE to raise a hard limit, so the runtime's setrlimit fails with EPERM."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)
    return [
        "--runtime",
        os.environ.get("RATCHET_CHECK_RUNTIME", "runc"),
        "--ulimit",
        f"nofile={nofile}:{nofile}",
        "--ulimit",
        f"nproc={nproc}:{nproc}",
    ]


def podman(*args: str, check: bool = True, timeout: float = 300) -> str:
    result = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and result.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])}: {result.stderr.strip()}")
    return result.stdout


@dataclass
class Report:
    failures: list[str] = field(default_factory=list)

    def check(self, name: str, ok: bool, detail: str) -> bool:
        print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)
        if not ok:
            self.failures.append(name)
        return ok

    def attempt(self, name: str, action: Callable[[], str]) -> bool:
        """Run one check whose failure is an exception; print what it returns."""
        try:
            return self.check(name, True, action())
        except Exception as exc:  # any failure is this check's, the others still run
            return self.check(name, False, f"{type(exc).__name__}: {exc}")


def build(learner: bool) -> None:
    env = dict(os.environ)
    for extra in [""] + (["--learner"] if learner else []):
        start = time.monotonic()
        command = ["ops/build-image.sh", *([extra] if extra else [])]
        subprocess.run(command, cwd=ROOT, env=env, check=True)
        print(f"build {extra or '(proxy, judge)'}: {time.monotonic() - start:.0f} s", flush=True)
        env.pop("REBUILD_BASE", None)  # one fresh base is enough for both images


def image_facts(report: Report, image: str) -> None:
    size = int(podman("image", "inspect", "--format", "{{.Size}}", image).strip())
    user = podman("image", "inspect", "--format", "{{.Config.User}}", image).strip()
    report.check(f"image {image}", user == f"{UID}:{GID}", f"{size / 1e6:.0f} MB, USER {user}")
    # The SBOM: every Python distribution in the image's venv, as pip reports it.
    listing = podman(
        "run", "--rm", *podman_run_flags(), "--network", "none", "--entrypoint", "pip",
        image, "list", "--format", "json",
    )  # fmt: skip
    packages = {p["name"].lower(): p["version"] for p in json.loads(listing)}
    sbom = ROOT / "bench" / "results" / f"sbom-{image.rsplit(':', 1)[-1]}.json"
    sbom.parent.mkdir(parents=True, exist_ok=True)
    sbom.write_text(json.dumps(packages, indent=1, sort_keys=True) + "\n")
    key = ["ratchet", "fastapi", "uvicorn", "kafka-python", "redis", "litellm", "torch", "peft"]
    named = ", ".join(f"{k}=={packages[k]}" for k in key if k in packages)
    report.check(
        f"SBOM {image}", "ratchet" in packages, f"{len(packages)} packages ({named}); {sbom}"
    )


@dataclass
class Host:
    """Kafka, Redis and vLLM of the embedded stack, and the folders the containers mount."""

    home: Path
    stack: Stack
    config: dict[str, Any]
    secret: str
    vllm_key: str
    model_path: Path


def start_host(home: Path) -> Host:
    # vLLM and the learner must name the base model by the same path (the learner writes it into
    # every adapter, vLLM's resolver compares): hard links of the prepared model in a folder the
    # container's user can reach, mounted read-only at the same path in the learner's container.
    model_path = home / "model"
    shutil.copytree(prepare_model(default_home(), quiet=True), model_path, copy_function=os.link)
    secret = uuid.uuid4().hex
    config: dict[str, Any] = {
        "kafka_bootstrap_servers": f"127.0.0.1:{free_port()}",
        "redis_url": f"redis://127.0.0.1:{free_port()}/0",
        "vllm_url": f"http://127.0.0.1:{free_port()}",
        "home": str(home / "host"),
        "store_dir": str(home / "adapters"),
        "secret": secret,
        "aliases": {ALIAS: {"base_model": BASE_MODEL}},
    }
    path = home / "host.yaml"
    path.write_text(yaml.safe_dump(config))
    settings = load_settings(path)
    stack = embedded_stack(settings, path, model_path, services=())
    print("starting kafka, redis and vllm on the host (vLLM takes a minute or more)", flush=True)
    stack.start()
    create_topics(settings)
    return Host(home, stack, config, secret, vllm_api_key(settings), model_path)


def container_config(host: Host, ports: dict[str, int]) -> Path:
    """The ratchet.yaml the chart's ConfigMap would hold, pointing at the host's services."""
    config = {
        "kafka_bootstrap_servers": host.config["kafka_bootstrap_servers"],
        "redis_url": host.config["redis_url"],
        "vllm_url": host.config["vllm_url"],
        "home": "/var/lib/ratchet",
        "store_dir": "/adapters",
        # Host network: bind loopback, so nothing here is reachable from off the machine.
        "proxy": {"host": "127.0.0.1", "port": ports["proxy"]},
        "judge": {"metrics_host": "127.0.0.1", "metrics_port": ports["judge"]},
        "learner": {
            "metrics_host": "127.0.0.1",
            "metrics_port": ports["learner"],
            "base_model_path": str(host.model_path),
            "device": "cpu",
        },
        # The judge reads every record but samples no groups: this checks the plumbing, and
        # sampling would load the CPU for minutes.
        "aliases": {ALIAS: {"base_model": BASE_MODEL, "learning": {"enabled": False}}},
    }
    folder = host.home / "etc-ratchet"
    folder.mkdir()
    (folder / "ratchet.yaml").write_text(yaml.safe_dump(config))
    return folder


def owned_dir(path: Path) -> str:
    """A writable volume, as the chart's emptyDir with fsGroup 10001 is."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, UID, GID)
    path.chmod(0o2770)
    return str(path)


def run_service(host: Host, name: str, image: str, etc: Path) -> str:
    """`ratchet <name>` as the chart's Deployment runs it; returns the container's name."""
    volumes = [
        f"{etc}:/etc/ratchet:ro",
        f"{owned_dir(host.home / name / 'state')}:/var/lib/ratchet",
        f"{owned_dir(host.home / name / 'tmp')}:/tmp",
    ]
    env = {
        "RATCHET_CONFIG": "/etc/ratchet/ratchet.yaml",
        "RATCHET_SECRET": host.secret,
        "RATCHET_VLLM_API_KEY": host.vllm_key,
        "HOME": "/tmp",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    extra: list[str] = []
    if name == "proxy":
        env["RATCHET_PROXY__API_KEYS"] = json.dumps([API_KEY])
    if name == "learner":
        volumes += [
            f"{owned_dir(host.home / 'adapters')}:/adapters",
            f"{owned_dir(host.home / name / 'models-cache')}:/models-cache",
            # The base model where vLLM reads it (learner.base_model_path).
            f"{host.model_path}:{host.model_path}:ro",
        ]
        env["HF_HOME"] = "/models-cache"
        extra = ["--shm-size", "1g"]
    # An env file rather than --env: the secret and keys stay out of `ps` (the chart: a Secret).
    env_file = host.home / f"{name}.env"
    env_file.touch(mode=0o600)
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    container = f"{NAME}-{name}"
    podman(
        "run", "--detach", "--name", container, *podman_run_flags(),
        "--network", "host",
        # securityContext: runAsUser/runAsGroup, readOnlyRootFilesystem, drop ALL,
        # allowPrivilegeEscalation false; seccompProfile RuntimeDefault is podman's default.
        "--user", f"{UID}:{GID}",
        *(["--read-only", "--read-only-tmpfs=false"] if READ_ONLY else []),
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
        *[a for v in volumes for a in ("--volume", v)],
        "--env-file", str(env_file),
        *extra,
        "--entrypoint", "ratchet", image, name, "--config", "/etc/ratchet/ratchet.yaml",
    )  # fmt: skip
    return container


def check_process(report: Report, container: str) -> None:
    """Every process of the container runs as 10001, seen from the host; the root is read-only."""
    pid = podman("inspect", "--format", "{{.State.Pid}}", container).strip()
    pids = [pid, *descendants(pid)]
    uids = {p: status_ids(p) for p in pids}
    ok = all(ids == {str(UID), str(GID)} for ids in uids.values())
    detail = ", ".join(f"pid {p} uid/gid {'/'.join(sorted(i))}" for p, i in uids.items())
    report.check(f"{container} user", ok, detail)
    readonly = podman("inspect", "--format", "{{.HostConfig.ReadonlyRootfs}}", container).strip()
    # Even root cannot write to the image's files; the chart's volumes take the writes.
    probe = subprocess.run(
        ["podman", "exec", "--user", "0", container, "touch", "/etc/ratchet-write-probe"],
        capture_output=True,
        text=True,
        check=False,
    )
    writable = podman(
        "exec", container, "sh", "-c", "touch /tmp/p /var/lib/ratchet/p && echo ok", check=False
    ).strip()
    report.check(
        f"{container} read-only root",
        readonly == str(READ_ONLY).lower()
        and ("Read-only file system" in probe.stderr) == READ_ONLY
        and writable == "ok",
        f"ReadonlyRootfs={readonly}; root writing /etc: {probe.stderr.strip() or 'allowed'}; "
        f"/tmp and /var/lib/ratchet writable: {writable == 'ok'}",
    )


def descendants(pid: str) -> list[str]:
    """The processes under `pid` (the proxy's log worker, vLLM-free here), from /proc."""
    parents: dict[str, str] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The parent pid is the second field after the parenthesised command name.
            parents[stat.parent.name] = stat.read_text().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue
    found, frontier = [], {pid}
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = set(children)
    return found


def status_ids(pid: str) -> set[str]:
    """Real, effective, saved and filesystem uids and gids of a process."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {v for ln in lines if ln.startswith(("Uid:", "Gid:")) for v in ln.split()[1:]}


def http_ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_http(container: str, url: str, timeout_s: float) -> None:
    def up() -> bool:
        if podman("inspect", "--format", "{{.State.Running}}", container).strip() != "true":
            raise RuntimeError(f"{container} exited:\n{podman('logs', '--tail', '30', container)}")
        return http_ready(url)

    wait_until(up, timeout_s, f"{url} of {container}", interval_s=0.5)


def chat(report: Report, proxy: str, bootstrap: str, settings_path: Path) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{proxy}/v1", api_key=API_KEY, timeout=300, max_retries=0)
    request_id = f"check-image-{uuid.uuid4().hex}"
    raw = client.chat.completions.with_raw_response.create(
        model=ALIAS,
        messages=[{"role": "user", "content": "Say hello in five words."}],
        max_tokens=16,
        extra_headers={"x-request-id": request_id},
    )
    reply = raw.parse()
    text = reply.choices[0].message.content or ""
    report.check(
        "chat completion through the proxy container",
        bool(text.strip()),
        f"model={reply.model} version={raw.headers.get('x-ratchet-version')} text={text!r}",
    )
    record = find_traffic(bootstrap, settings_path, request_id, timeout_s=60)
    report.check(
        f"TrafficRecord on {TRAFFIC_TOPIC}",
        record is not None and record.response_id == reply.id,
        "not found in 60 s"
        if record is None
        else f"request_id={record.request_id} alias={record.alias} status={record.status} "
        f"response_id={record.response_id} latency_ms={record.latency_ms:.0f}",
    )


def find_traffic(
    bootstrap: str, settings_path: Path, client_request_id: str, timeout_s: float
) -> TrafficRecord | None:
    settings = load_settings(settings_path)
    consumer = make_consumer(
        bootstrap, settings.kafka, [TRAFFIC_TOPIC], None, consumer_timeout_ms=1000
    )
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            for message in consumer:
                record = decode(message.topic, message.value)
                if (
                    isinstance(record, TrafficRecord)
                    and record.client_request_id == client_request_id
                ):
                    return record
    finally:
        consumer.close()
    return None


def metric(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        s.value
        for family in text_string_to_metric_families(httpx.get(url, timeout=5).text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def run_checks(args: argparse.Namespace, report: Report, home: Path) -> None:
    images = {"proxy": args.image, "judge": args.image}
    if not args.no_learner:
        images["learner"] = args.learner_image
    for image in dict.fromkeys(images.values()):
        image_facts(report, image)
    host = start_host(home)
    try:
        ports = {name: free_port() for name in ("proxy", "judge", "learner")}
        etc = container_config(host, ports)
        containers = {name: run_service(host, name, image, etc) for name, image in images.items()}
        try:
            services(report, host, ports, containers, etc)
        finally:
            for container in containers.values():
                logs = subprocess.run(
                    ["podman", "logs", "--tail", "5", container],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    check=False,
                ).stdout.strip()
                print(f"--- {container}, last lines of its log ---\n{logs}", flush=True)
                podman("rm", "--force", "--time", "20", container, check=False)
    finally:
        host.stack.stop()


def services(
    report: Report, host: Host, ports: dict[str, int], containers: dict[str, str], etc: Path
) -> None:
    proxy = f"http://127.0.0.1:{ports['proxy']}"
    metrics = {n: f"http://127.0.0.1:{ports[n]}/metrics" for n in ("judge", "learner")}
    report.attempt("proxy /readyz", lambda: ready(containers["proxy"], proxy))
    for name in ("judge", "learner"):
        if name in containers:
            report.attempt(
                f"{name} /metrics", partial(scrape, containers[name], metrics[name], name)
            )
    for container in containers.values():
        check_process(report, container)
    try:
        chat(report, proxy, host.config["kafka_bootstrap_servers"], etc / "ratchet.yaml")
    except Exception as exc:
        report.check("chat completion through the proxy container", False, repr(exc))
        return

    def judged() -> bool:
        skipped = metric(metrics["judge"], "ratchet_judge_skipped_total", alias=ALIAS)
        return skipped >= 1

    def judge_read() -> str:
        wait_until(judged, 60, "the judge's ratchet_judge_skipped_total", 0.5)
        return "ratchet_judge_skipped_total{reason=learning_disabled} counted it"

    report.attempt("judge container read the record from Kafka", judge_read)


def ready(container: str, proxy: str) -> str:
    """Ready, and its log worker connected to Kafka (it connects after the first readiness)."""
    wait_http(container, f"{proxy}/readyz", 120)

    def kafka() -> bool:
        body = httpx.get(f"{proxy}/readyz", timeout=5).json()
        return bool(body["ready"] and body["kafka"])

    wait_until(kafka, 60, "the proxy's /readyz to show kafka: true", interval_s=0.5)
    return httpx.get(f"{proxy}/readyz", timeout=5).text.strip()


def scrape(container: str, url: str, name: str) -> str:
    wait_http(container, url, 300)
    families = [ln for ln in httpx.get(url, timeout=5).text.splitlines() if ln.startswith("# TYPE")]
    own = [ln for ln in families if f"ratchet_{name}_" in ln]
    return f"200, {len(families)} metric families ({len(own)} ratchet_{name}_*)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-build", action="store_true", help="use the images as they are")
    parser.add_argument("--no-learner", action="store_true", help="no torch image, no learner")
    parser.add_argument("--image", default=f"localhost/ratchet:{VERSION}")
    parser.add_argument("--learner-image", default=f"localhost/ratchet:{VERSION}-cpu")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("run as root: podman's system storage, and the volumes are chowned to 10001")
        return 2
    if shutil.which("runc") is None:  # podman's runtime here (see podman_run_flags)
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "runc"], check=True)
    tools = [subprocess.run([t, "--version"], capture_output=True, text=True).stdout.strip()
             for t in ("buildah", "podman", "runc")]  # fmt: skip
    print(" | ".join(t.splitlines()[0] for t in tools if t), flush=True)
    started = time.monotonic()
    if not args.skip_build:
        build(learner=not args.no_learner)
    report = Report()
    # Not under /tmp: the containers mount their own /tmp, and the model is mounted at its path.
    home = Path(tempfile.mkdtemp(prefix="ratchet-check-image-", dir="/var/tmp"))
    home.chmod(0o755)  # the containers' user traverses it to reach its volumes
    try:
        run_checks(args, report, home)
    except Exception as exc:
        report.check("run", False, f"{type(exc).__name__}: {exc}")
    finally:
        shutil.rmtree(home, ignore_errors=True)
    took = f"{time.monotonic() - started:.0f} s"
    if report.failures:
        print(f"FAILED ({took}): {', '.join(report.failures)}")
        return 1
    print(f"all checks passed ({took})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
