"""Export rows, shards and dataset cards, read back by Hugging Face `datasets` as a user would;
the gate-pairs export end to end against a real Redis (Kafka's kinds run in
tests/integration/test_loop_mechanics.py, on a real run's records)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
import yaml

from cli.export.rows import SCHEMAS, dataset_card, group_row, rating_row, traffic_row
from cli.export.run import ExportError, ExportState, begin, export, since_ms, write_shard
from ratchet.gate_pairs import GatePair, write_gate_pairs
from ratchet.records import FeedbackRecord, Sample, ScoredGroup, TrafficRecord
from ratchet.settings import AliasConfig, RatchetSettings
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
