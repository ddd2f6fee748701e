"""`ratchet export` against the real broker: records the producer sent in one batch (which the
embedded Tansu reports as a single offset at the end of the partition) are all exported, by an
export interrupted after its first shard and continued by the command, each row once. A real
run's groups, ratings, pairs and traffic are exported in test_loop_mechanics.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from kafka import KafkaProducer

from cli.exporter.run import begin, export
from ratchet.records import GROUPS_TOPIC, Sample, ScoredGroup
from ratchet.settings import load_settings
from tests.integration.conftest import BASE_MODEL, Embedded, ratchet_cli

pytestmark = pytest.mark.integration


def group(alias: str, i: int) -> ScoredGroup:
    sample = Sample(
        message={"role": "assistant", "content": "a"}, text="a", token_ids=[1], logprobs=[-0.1]
    )
    return ScoredGroup(
        group_id=f"{alias}-{i}",
        alias=alias,
        version=0,
        response_model=BASE_MODEL,
        prompt_messages=[{"role": "user", "content": f"question {i}"}],
        prompt_token_ids=[1, 2],
        samples=[sample, sample],
        rewards=[0.0, 1.0],
        traffic_request_id=f"{alias}-r{i}",
    )


def test_an_interrupted_export_continues_and_takes_every_record_of_a_batch_once(
    embedded: Embedded, tmp_path: Path
) -> None:
    config = yaml.safe_load(embedded.config_path.read_text())
    config["aliases"] = {
        "ex-batch": {"base_model": BASE_MODEL},
        "ex-other": {"base_model": BASE_MODEL},
    }
    path = tmp_path / "ratchet.yaml"
    path.write_text(yaml.safe_dump(config))
    settings = load_settings(path)
    producer = KafkaProducer(bootstrap_servers=settings.kafka_bootstrap_servers, linger_ms=200)
    for i in range(12):  # one batch per alias's partition
        for alias in ("ex-batch", "ex-other"):
            producer.send(GROUPS_TOPIC, key=alias.encode(), value=group(alias, i).to_json())
    producer.flush(30)
    producer.close()

    out = tmp_path / "export"
    state = begin(settings, out, "ex-batch", "groups", "jsonl", None)

    def stop_after_a_shard(done: int, total: int) -> None:
        if any((out / "data").glob("part-*.jsonl")):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export(settings, out, state, 5, stop_after_a_shard)
    run = ratchet_cli(
        "export", "ex-batch", "--format", "jsonl", "--out", str(out), "--shard-rows", "5",
        "--config", str(path),
    )  # fmt: skip
    assert run.returncode == 0 and "continuing the export" in run.stdout, run.stdout + run.stderr
    assert "12 rows of groups" in run.stdout, run.stdout

    from datasets import load_dataset

    rows = load_dataset(str(out), split="train")  # through the dataset card, as the Hub would
    assert sorted(rows["group_id"], key=lambda g: int(g.rsplit("-", 1)[1])) == [
        f"ex-batch-{i}" for i in range(12)
    ]
    again = ratchet_cli(
        "export", "ex-batch", "--format", "jsonl", "--out", str(out), "--config", str(path)
    )
    assert again.returncode == 0 and "is complete: 12 rows" in again.stdout, again.stdout
