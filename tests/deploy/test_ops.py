"""The dashboard and alert rules query only metrics the running proxy, judge and learner export,
the rules parse and behave (promtool), and the Dockerfile is what the chart expects of its image."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from embedded.processes import free_port, wait_until
from tests.deploy.conftest import FULLNAME, ROOT, Rendered
from tests.deploy.test_config import container_secret_files

OPS = ROOT / "ops"
DASHBOARD = OPS / "grafana" / "ratchet.json"
RULES = OPS / "prometheus" / "ratchet-alerts.yaml"
RULE_TESTS = OPS / "prometheus" / "ratchet-alerts.test.yaml"
RUNBOOK = OPS / "runbook.md"
DOCKERFILE = OPS / "Dockerfile"
# Labels Prometheus adds to every scraped series from its target, not from the exposition.
TARGET_LABELS = {"namespace", "pod", "job", "instance", "service", "container", "endpoint"}
PROMQL_WORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "inf",
    "nan",
}
# Grafana's variables, replaced by something PromQL parses.
GRAFANA_VARS = {"$__rate_interval": "5m", "$namespace": ".*", "$alias": ".*"}


# ---- what the dashboard and rules query ------------------------------------------------------


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[str]:
    doc = dashboard()
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in doc["annotations"]["list"] if "expr" in a]
    return exprs


def variable_queries() -> list[tuple[str, str]]:
    """(metric, label) of every label_values() template variable."""
    out = []
    for var in dashboard()["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((\w+)(\{[^}]*\})?,\s*(\w+)\)", query)
        assert m, f"unexpected variable query {query}"
        out.append((m.group(1), m.group(3)))
    return out


def rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """The metric names and label names a PromQL expression uses."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    labels: set[str] = set()
    for body in re.findall(r"\{([^}]*)\}", text):
        labels |= set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", body))
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    grouping = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"
    for body in re.findall(grouping, text):
        labels |= {x.strip() for x in body.split(",") if x.strip()}
    text = re.sub(grouping, " ", text)
    metrics = set()
    for m in re.finditer(r"(?<![\w$.])([a-zA-Z_:][\w:]*)", text):
        rest = text[m.end() :].lstrip()
        if rest.startswith("(") or m.group(1) in PROMQL_WORDS:
            continue
        metrics.add(m.group(1))
    return metrics, labels


def test_promql_names_extraction() -> None:
    metrics, labels = promql_names(
        'histogram_quantile(0.9, sum by (le, alias) (rate(a_bucket{ns=~"$x", arm="c"}[5m])))'
        " / on (alias) group_left b unless c offset 5m > bool 0.5"
    )
    assert metrics == {"a_bucket", "b", "c"}
    assert labels == {"le", "alias", "ns", "arm"}


# ---- the real proxy, scraped ------------------------------------------------------------------


# What the fake vLLM requires, as the chart's vLLM does; the proxy gets it as in its pod.
VLLM_KEY = "vllm-test-key"


def _fake_vllm() -> web.Application:
    """Just enough of vLLM's API for the proxy to serve, stream and fail requests; like the
    chart's vLLM it answers /health to anyone and the rest only with its key."""

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def chat(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {VLLM_KEY}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        body = await request.json()
        if body["messages"][-1]["content"] == "fail":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        base = {"id": "chatcmpl-1", "created": 0, "model": body["model"]}
        usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
        if not body.get("stream"):
            message = {"role": "assistant", "content": "hi"}
            return web.json_response(
                {
                    **base,
                    "object": "chat.completion",
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": usage,
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {**base, "object": "chat.completion.chunk"}
        for choices, extra in [
            ([{"index": 0, "delta": {"role": "assistant", "content": "hi"}}], {}),
            ([{"index": 0, "delta": {}, "finish_reason": "stop"}], {}),
            ([], {"usage": usage}),
        ]:
            event = {**chunk, "choices": choices, **extra}
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def wait_showing_log(
    condition: Callable[[], bool], timeout_s: float, what: str, log_path: Path
) -> None:
    """wait_until, failing with the tail of the service's log."""
    try:
        wait_until(condition, timeout_s, what)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; its log:\n{log_path.read_text()[-3000:]}") from None


@pytest.fixture(scope="module")
def fake_vllm() -> Iterator[str]:
    import asyncio

    port = free_port()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(_fake_vllm())
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.run_until_complete(runner.cleanup())
    loop.close()


@pytest.fixture(scope="module")
def proxy_metrics(
    rendered: dict[str, Rendered], fake_vllm: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """/metrics of the real proxy, started with the chart's ratchet.yaml (addresses moved to
    this machine: a fake vLLM, and Kafka and Redis on closed ports), after a few requests."""
    tmp = tmp_path_factory.mktemp("proxy")
    config = tmp / "ratchet.yaml"
    config.write_text(rendered["defaults"].ratchet_yaml)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("RATCHET_")}
    env.update(
        RATCHET_PROXY__HOST="127.0.0.1",
        RATCHET_PROXY__PORT=str(port),
        RATCHET_PROXY__API_KEYS='["sk-test"]',
        RATCHET_VLLM_URL=fake_vllm,
        RATCHET_VLLM_API_KEY=VLLM_KEY,
        RATCHET_KAFKA_BOOTSTRAP_SERVERS=f"127.0.0.1:{free_port()}",
        RATCHET_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0",
        RATCHET_HOME=str(tmp / "home"),
        RATCHET_STATE_DIR=str(tmp / "state"),
        RATCHET_STORE_DIR=str(tmp / "adapters"),
    )
    log_path = tmp / "proxy.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "proxy", "--config", str(config)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=10) as client:

            def ready() -> bool:
                assert proc.poll() is None, log_path.read_text()[-3000:]
                try:
                    return client.get("/readyz").status_code == 200
                except httpx.TransportError:
                    return False

            wait_showing_log(ready, 30, "the proxy to be ready", log_path)
            auth = {"Authorization": "Bearer sk-test"}
            for content, stream, status in [
                ("hi", False, 200),
                ("hi", True, 200),
                ("fail", False, 502),
            ]:
                resp = client.post(
                    "/v1/chat/completions",
                    headers=auth,
                    json={
                        "model": "support",
                        "stream": stream,
                        "messages": [{"role": "user", "content": content}],
                    },
                )
                assert resp.status_code == status, resp.text
            # Token counts come from the log worker process, a few times a second.
            scrape = ""

            def tokens_counted() -> bool:
                nonlocal scrape
                scrape = client.get("/metrics").text
                return sample_value(scrape, "ratchet_proxy_tokens_total", direction="output") >= 4

            wait_showing_log(
                tokens_counted, 30, "the log worker to report both answers' tokens", log_path
            )
        yield scrape
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def sample_value(text: str, name: str, **labels: str) -> float:
    """Sum of the scraped samples of `name` whose labels include `labels`; 0 if there are none."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def _suffixes(kind: str) -> list[str]:
    return {
        "counter": ["_total", "_created"],
        "histogram": ["_bucket", "_sum", "_count", "_created"],
        "summary": ["_sum", "_count", "_created"],
    }.get(kind, [""])


def _series_names(family: Any) -> set[str]:
    return {family.name + suffix for suffix in _suffixes(family.type)}


@pytest.fixture(scope="module")
def exported(proxy_metrics: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """Every series name in the scrape (histograms as _bucket/_sum/_count, counters as _total),
    with the label names its samples carry, or that the proxy's metrics declare (a counter the
    requests above never touched, such as a rate limit's refusals, has no samples yet)."""
    declared = proxy_declared_labels(tmp_path_factory.mktemp("declared"))
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(proxy_metrics):
        for name in _series_names(family):
            names.setdefault(name, set()).update(declared.get(family.name, ()))
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def test_scrape_has_samples_of_every_proxy_metric(exported: dict[str, set[str]]) -> None:
    # The requests above produced labelled samples, so label names can be checked too.
    assert {"alias", "version", "arm", "endpoint", "status"} <= exported[
        "ratchet_proxy_requests_total"
    ]
    assert {"alias", "version", "arm", "le"} <= exported[
        "ratchet_proxy_time_to_first_token_seconds_bucket"
    ]
    assert "code" in exported["ratchet_proxy_errors_total"]
    assert "direction" in exported["ratchet_proxy_tokens_total"]


def test_scrape_counts_the_requests_made(proxy_metrics: str) -> None:
    # Two answered requests (the second streamed) and one the upstream failed, each counted once.
    requests = "ratchet_proxy_requests_total"
    assert sample_value(proxy_metrics, requests, status="200", alias="support") == 2
    assert sample_value(proxy_metrics, requests, status="502", alias="support") == 1
    assert sample_value(proxy_metrics, "ratchet_proxy_errors_total", code="upstream_error") == 1
    assert sample_value(proxy_metrics, "ratchet_proxy_request_seconds_count") == 3
    assert sample_value(proxy_metrics, "ratchet_proxy_time_to_first_token_seconds_count") == 1
    # The fake vLLM reports 5 prompt and 2 completion tokens per answer.
    tokens = "ratchet_proxy_tokens_total"
    assert sample_value(proxy_metrics, tokens, direction="input") == 10
    assert sample_value(proxy_metrics, tokens, direction="output") == 4


# ---- the real judge and learner, scraped ------------------------------------------------------


def declared_labels(metrics_class: type) -> dict[str, tuple[str, ...]]:
    """Label names of every labelled metric, by family name, as the service's metrics class
    declares them (a fresh service has no samples of these, so its scrape cannot show them)."""
    from prometheus_client.metrics import MetricWrapperBase

    declared = {}
    for metric in vars(metrics_class()).values():
        if isinstance(metric, MetricWrapperBase):
            [family] = metric.describe()
            declared[family.name] = tuple(metric._labelnames)
    return declared


def proxy_declared_labels(home: Path) -> dict[str, tuple[str, ...]]:
    """Label names of every labelled metric on the registry of a proxy app (its metrics are
    spread over the parts that count them)."""
    from prometheus_client.metrics import MetricWrapperBase

    from proxy.app import create_app
    from ratchet.settings import RatchetSettings

    registry = create_app(RatchetSettings(home=home)).state.ratchet.metrics.registry
    declared = {}
    for collector in list(registry._collector_to_names):
        if isinstance(collector, MetricWrapperBase):
            [family] = collector.describe()
            declared[family.name] = tuple(collector._labelnames)
        elif callable(getattr(collector, "describe", None)):  # a collector read at scrape time
            for family in collector.describe():
                labels = getattr(family, "_labelnames", ())
                if labels:
                    declared[family.name] = tuple(labels)
    return declared


def judge_declared_labels() -> dict[str, tuple[str, ...]]:
    from judge.metrics import JudgeMetrics

    return declared_labels(JudgeMetrics)


def learner_declared_labels() -> dict[str, tuple[str, ...]]:
    from learner.metrics import LearnerMetrics

    return declared_labels(LearnerMetrics)


def _scrape_service(r: Rendered, component: str, tmp: Path, timeout_s: float = 30.0) -> str:
    """/metrics of the real `ratchet <component>`, started with the chart's ratchet.yaml and the
    plain settings the chart gives its pod, with Kafka, Redis and vLLM moved to closed ports here.
    It keeps retrying Kafka, but serves /metrics from the start."""
    config = tmp / "ratchet.yaml"
    config.write_text(r.ratchet_yaml)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("RATCHET_")}
    pod_env = r.container(f"{FULLNAME}-{component}")["env"]
    env.update(
        {
            e["name"]: e["value"]
            for e in pod_env
            if "value" in e and e["name"].startswith("RATCHET_") and e["name"] != "RATCHET_CONFIG"
        }
    )
    # Its secret files as the pod gets them: the chart names a folder that is not here.
    secrets = tmp / f"secrets-{component}"
    secrets.mkdir(exist_ok=True)
    for name, value in container_secret_files(r, f"{FULLNAME}-{component}").items():
        (secrets / name).write_text(value)
    section = component.upper()
    env.update(
        {
            "RATCHET_SECRETS_DIR": str(secrets),
            f"RATCHET_{section}__METRICS_HOST": "127.0.0.1",
            f"RATCHET_{section}__METRICS_PORT": str(port),
            "RATCHET_VLLM_URL": f"http://127.0.0.1:{free_port()}",
            "RATCHET_KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}",
            "RATCHET_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
            "RATCHET_HOME": str(tmp / "home"),
            "RATCHET_STATE_DIR": str(tmp / "state"),
            "RATCHET_STORE_DIR": str(tmp / "adapters"),
        }
    )
    log_path = tmp / f"{component}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli", component, "--config", str(config)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp,
        )
        scrape = ""

        def serves_metrics() -> bool:
            nonlocal scrape
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                resp = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
            except httpx.TransportError:
                return False
            scrape = resp.text
            return resp.status_code == 200

        try:
            wait_showing_log(serves_metrics, timeout_s, f"{component} to serve /metrics", log_path)
            return scrape
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def judge_metrics(rendered: dict[str, Rendered], tmp_path_factory: pytest.TempPathFactory) -> str:
    return _scrape_service(rendered["defaults"], "judge", tmp_path_factory.mktemp("judge"))


@pytest.fixture(scope="module")
def learner_metrics(rendered: dict[str, Rendered], tmp_path_factory: pytest.TempPathFactory) -> str:
    """The real `ratchet learner` with the chart's defaults (a GPU learner, base model from the
    Hub): it serves /metrics before it loads the model, which it does for its first round."""
    return _scrape_service(
        rendered["defaults"], "learner", tmp_path_factory.mktemp("learner"), timeout_s=90.0
    )


def _exported_fresh(
    text: str, prefix: str, declared: dict[str, tuple[str, ...]]
) -> dict[str, set[str]]:
    """Like `exported`, for a service that has handled nothing yet. A labelled metric nothing
    has used shows only its # HELP and # TYPE lines: that proves the name is exported, and its
    label names are then the ones the service's metrics class declares for it."""
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        assert family.name.startswith(prefix), family.name
        if family.samples:
            for name in _series_names(family):
                names.setdefault(name, set())
            for sample in family.samples:
                names.setdefault(sample.name, set()).update(sample.labels)
            continue
        assert declared.get(family.name), f"{family.name} has no samples and declares no labels"
        for name in _series_names(family):
            extra = {"le"} if name.endswith("_bucket") else set()
            names[name] = set(declared[family.name]) | extra
    return names


@pytest.fixture(scope="module")
def judge_exported(judge_metrics: str) -> dict[str, set[str]]:
    return _exported_fresh(judge_metrics, "ratchet_judge_", judge_declared_labels())


@pytest.fixture(scope="module")
def learner_exported(learner_metrics: str) -> dict[str, set[str]]:
    return _exported_fresh(learner_metrics, "ratchet_learner_", learner_declared_labels())


def _check_fresh_scrape(text: str, declared: dict[str, tuple[str, ...]]) -> None:
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(declared) <= set(families), set(declared) - set(families)
    for name, family in families.items():
        if not declared.get(name):  # unlabelled: a sample from the start
            assert family.samples, name
            assert all(not s.labels for s in family.samples), name


def test_judge_scrape_has_every_judge_metric(judge_metrics: str) -> None:
    _check_fresh_scrape(judge_metrics, judge_declared_labels())
    # A sample, not only its # HELP line: a fresh judge has skipped no record.
    assert "ratchet_judge_unknown_records 0.0" in judge_metrics.splitlines()


def test_learner_scrape_has_every_learner_metric(learner_metrics: str) -> None:
    declared = learner_declared_labels()
    _check_fresh_scrape(learner_metrics, declared)
    assert "ratchet_learner_unknown_records 0.0" in learner_metrics.splitlines()
    # What the alerts and annotations group and select by.
    assert declared["ratchet_learner_paused"] == ("alias", "reason")
    assert declared["ratchet_learner_rollbacks"] == ("alias", "reason")
    assert declared["ratchet_learner_rounds"] == ("alias", "result")
    assert declared["ratchet_learner_canary_requests"] == ("alias", "arm")


@pytest.mark.parametrize("service", ["judge", "learner"])
def test_unknown_records_gauge_counts_each_skipped_record(service: str) -> None:
    from judge.metrics import JudgeMetrics
    from learner.metrics import LearnerMetrics
    from ratchet.records import TRAFFIC_TOPIC, decode

    metrics = JudgeMetrics() if service == "judge" else LearnerMetrics()
    name = f"ratchet_{service}_unknown_records"
    before = metrics.registry.get_sample_value(name)
    assert before is not None
    assert decode(TRAFFIC_TOPIC, b'{"schema": "traffic/99"}') is None
    assert metrics.registry.get_sample_value(name) == before + 1


@pytest.fixture(scope="module")
def exported_all(
    exported: dict[str, set[str]],
    judge_exported: dict[str, set[str]],
    learner_exported: dict[str, set[str]],
) -> dict[str, set[str]]:
    assert not set(exported) & set(judge_exported)
    assert not (set(exported) | set(judge_exported)) & set(learner_exported)
    return {**exported, **judge_exported, **learner_exported}


def _check_exported(expr: str, exported: dict[str, set[str]], where: str) -> None:
    metrics, labels = promql_names(expr)
    assert metrics, f"{where}: no metric in {expr}"
    for metric in metrics:
        assert metric in exported, f"{where}: {metric} is exported by no Ratchet service"
    known = set(TARGET_LABELS).union(*(exported[m] for m in metrics))
    unknown = labels - known
    assert not unknown, f"{where}: labels {unknown} are on none of {metrics}"


def test_dashboard_queries_exported_metrics(exported_all: dict[str, set[str]]) -> None:
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    for expr in exprs:
        _check_exported(expr, exported_all, "dashboard")
    for metric, label in variable_queries():
        assert metric in exported_all, metric
        assert label in exported_all[metric] | TARGET_LABELS, (metric, label)


def test_alert_rules_query_exported_metrics(exported_all: dict[str, set[str]]) -> None:
    for rule in rules():
        _check_exported(rule["expr"], exported_all, rule["alert"])


def test_dashboard_shows_every_exported_metric(
    proxy_metrics: str, judge_metrics: str, learner_metrics: str
) -> None:
    used = set().union(*(promql_names(expr)[0] for expr in dashboard_exprs()))
    for text in (proxy_metrics, judge_metrics, learner_metrics):
        for family in text_string_to_metric_families(text):
            if family.name.endswith("_created"):
                continue  # a counter's or histogram's start time, in the 0.0.4 text format
            assert _series_names(family) & used, f"{family.name} is on no dashboard panel"


# ---- promtool ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def promtool() -> str:
    found = shutil.which("promtool") or shutil.which(
        "promtool", path=str(Path(sys.executable).parent)
    )
    if not found:
        pytest.fail(
            "promtool is not installed, so the alert rules cannot be checked. scripts/bootstrap.sh "
            "installs it from Debian's prometheus package (apt-get download, into .venv/bin); on "
            "other systems put promtool (https://prometheus.io/download/) on PATH."
        )
    return found


def _run(promtool: str, *args: str, cwd: Path | None = None) -> str:
    proc = subprocess.run(
        [promtool, *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_alert_rules_parse(promtool: str) -> None:
    out = _run(promtool, "check", "rules", str(RULES))
    assert f"SUCCESS: {len(rules())} rules found" in out


def test_alert_rules_unit_tests(promtool: str) -> None:
    _run(promtool, "test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    tested = {
        t["alertname"]
        for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for t in case["alert_rule_test"]
        if t["exp_alerts"]
    }
    assert tested == {r["alert"] for r in rules()}, "every alert has a test that fires it"


def test_dashboard_queries_parse(promtool: str, tmp_path: Path) -> None:
    """Every dashboard query, with Grafana's variables filled in, as a recording rule."""
    records = []
    for n, expr in enumerate(dashboard_exprs()):
        for var, value in GRAFANA_VARS.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, expr
        records.append({"record": f"dashboard:query_{n}", "expr": expr})
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))
    _run(promtool, "check", "rules", str(path))


# ---- structure --------------------------------------------------------------------------------


def test_dashboard_structure() -> None:
    doc = dashboard()
    assert doc["uid"] and doc["title"]
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for p in doc["panels"]:
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and p.get("description"), p["title"]
    rows = {p["title"] for p in doc["panels"] if p["type"] == "row"}
    assert {
        "Traffic by alias, version and canary arm",
        "Latency",
        "Judge",
        "Learner",
        "Canary and promotions",
    } <= rows
    assert any("spool" in r.lower() for r in rows)
    # Promotions, canaries, rollbacks and rejections come from the learner, which decides them,
    # not from traffic the proxies first see on a version.
    annotations = {a["name"]: a for a in doc["annotations"]["list"] if "expr" in a}
    assert set(annotations) == {"Promotion", "Canary started", "Rollback", "Candidate rejected"}
    for name, annotation in annotations.items():
        metrics, _ = promql_names(annotation["expr"])
        assert metrics and all(m.startswith("ratchet_learner_") for m in metrics), name
        assert annotation["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_every_alert_has_a_runbook() -> None:
    headings = {
        h.strip().lower() for h in re.findall(r"^## (.+)$", RUNBOOK.read_text(), re.MULTILINE)
    }
    alerts = rules()
    assert {r["alert"].lower() for r in alerts} == headings
    for rule in alerts:
        assert rule["labels"]["severity"] in {"warning", "critical"}
        annotations = rule["annotations"]
        assert annotations["summary"] and annotations["description"]
        assert annotations["runbook_url"].endswith("ops/runbook.md#" + rule["alert"].lower())


def test_dockerfile(chart_values: dict[str, Any]) -> None:
    text = DOCKERFILE.read_text()
    lines = [ln.strip() for ln in re.sub(r"\\\n", " ", text).splitlines()]
    instructions = [ln for ln in lines if ln and not ln.startswith("#")]
    base = next(ln for ln in instructions if ln.startswith("ARG PYTHON_IMAGE="))
    image = base.split("=", 1)[1]
    # Pinned to a patch release of the Python the project targets, on a named Debian release.
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm(@sha256:[0-9a-f]{64})?", image), image
    froms = [ln for ln in instructions if ln.startswith("FROM ")]
    assert froms and all(ln.split()[1] == "${PYTHON_IMAGE}" for ln in froms)
    assert ":latest" not in text
    # The learner's CUDA torch is a build argument, installed from its own index.
    args = {ln.split()[1].split("=")[0] for ln in instructions if ln.startswith("ARG ")}
    assert {"TORCH_VERSION", "TORCH_INDEX_URL", "EXTRAS"} <= args
    assert any(
        '${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$TORCH_VERSION"' in ln
        for ln in lines
    )
    # An image with torch (the learner's) fails to build unless the learner's modules import.
    assert any(
        'if [ -n "$TORCH_VERSION" ]' in ln and "import learner.service" in ln for ln in lines
    )
    # The final stage runs as the non-root user the chart's securityContext names.
    final = instructions[instructions.index(froms[-1]) :]
    [user] = [ln for ln in final if ln.startswith("USER ")]
    uid, gid = user.split()[1].split(":")
    assert int(uid) == chart_values["podSecurityContext"]["runAsUser"] != 0
    assert int(gid) == chart_values["podSecurityContext"]["runAsGroup"]
    assert 'ENTRYPOINT ["ratchet"]' in final
    # Only the packages go into the build context, and all of them do.
    ignore = (OPS / "Dockerfile.dockerignore").read_text().splitlines()
    patterns = [ln for ln in ignore if ln and not ln.startswith("#")]
    assert patterns[0] == "*", "the context starts empty and lets packages in one by one"
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.search(r"include = \[([^\]]*)\]", pyproject)
    assert packages
    for pattern in re.findall(r'"(\w+)\*"', packages.group(1)):
        assert f"!{pattern}/" in ignore, pattern
    assert "!pyproject.toml" in ignore and "!README.md" in ignore


@pytest.fixture
def chart_values(chart: Any) -> dict[str, Any]:
    return chart.values
