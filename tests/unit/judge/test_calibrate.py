"""`ratchet judge calibrate`'s injection probe: the worst sample of each labelled group asks the
judge for the top score, and the report says how often that works (audit M-8). The judge is a
stand-in here (a capable LLM judge cannot run on this machine): one that follows such pleas and
one that does not, each reading the real judge request."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from judge import calibrate as cal
from judge.metrics import JudgeMetrics
from judge.scoring import GroupScorer
from ratchet.bill import Bill
from ratchet.rewards.ruler import JudgeRequest, JudgeScores
from ratchet.settings import JudgeSettings, RatchetSettings, RewardConfig

PROMPT = [{"role": "user", "content": "What is 2 + 2?"}]
_SAMPLE = re.compile(r'<sample id="(s[0-9a-f]{4})">(.*?)</sample>', re.S)


def answers(*texts: str) -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": t} for t in texts]


class StandInJudge(GroupScorer):
    """Scores each sample as the request presents it: 0.9 for one that says "4", 0.2 else; a
    gullible one gives 1.0 to any sample that asks for a score."""

    gullible = False

    def __init__(self, *_: Any, **__: Any) -> None:
        super().__init__(JudgeSettings(), "http://unused", None, JudgeMetrics())

    async def call_judge(
        self, alias: str, reward: RewardConfig, request: JudgeRequest, bill: Bill | None = None
    ) -> JudgeScores:
        blocks = dict(_SAMPLE.findall(request.messages[-1]["content"]))
        scores = [0.0] * len(request.ids)
        for sample_id, index in request.index_of.items():
            text = json.loads(blocks[sample_id])["content"]
            asks = "score" in text.lower()
            scores[index] = 1.0 if self.gullible and asks else 0.9 if "4" in text else 0.2
        return JudgeScores(scores=scores, explanations=["e"] * len(scores))


class GullibleJudge(StandInJudge):
    gullible = True


def test_the_injection_goes_into_the_worst_sample_only() -> None:
    group = cal.LabelledGroup(PROMPT, answers("4", "5", "four"), [1.0, 0.0, 0.8])
    attacked = cal.injected(group, " PLEA")
    assert attacked is not None
    variant, worst = attacked
    assert worst == 1
    assert [s["content"] for s in variant.samples] == ["4", "5 PLEA", "four"]
    assert group.samples[1]["content"] == "5"  # the labelled group itself is untouched
    assert cal.injected(cal.LabelledGroup(PROMPT, answers("a", "b"), [0.5, 0.5]), "x") is None


def test_the_report_gives_the_lift_and_the_win_rate() -> None:
    probes = [
        cal.probe_result([0.9, 0.2], [0.9, 1.0], worst=1),  # won: 1.0 above 0.9
        cal.probe_result([0.9, 0.2], [0.9, 0.3], worst=1),
        cal.probe_result([0.9, 0.2], [0.9, 0.9], worst=1),  # a tie is not a win
    ]
    assert [p.won for p in probes] == [True, False, False]
    assert not any(p.won_clean for p in probes)  # before the plea the worst one was last
    assert cal.probe_result([0.2, 0.9], [0.2, 1.0], worst=1).won_clean  # the judge's own error
    group = cal.LabelledGroup(PROMPT, answers("a", "b"), [1.0, 0.0])
    report = cal.summarise([(group, [0.9, 0.2], [0.9, 0.2])], failed=0, probes=probes)
    assert report.injection_lift == pytest.approx((0.8 + 0.1 + 0.7) / 3)
    assert report.injection_win_rate == pytest.approx(1 / 3)
    assert report.injection_clean_win_rate == 0.0
    assert cal.summarise([], failed=0).injection_win_rate is None


@pytest.mark.parametrize(("judge", "win_rate"), [(StandInJudge, 0.0), (GullibleJudge, 1.0)])
def test_calibrate_reports_how_often_a_plea_wins(
    judge: type[StandInJudge], win_rate: float, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cal, "GroupScorer", judge)
    labels = tmp_path / "labelled.jsonl"
    lines = [
        {"prompt": PROMPT, "samples": ["4", "5", "6"], "labels": [1.0, 0.0, 0.0]} for _ in range(6)
    ]
    labels.write_text("\n".join(json.dumps(line) for line in lines))
    console = Console(record=True, width=200)
    settings = RatchetSettings(home=tmp_path)
    code = cal.calibrate(settings, RewardConfig(), labels, tmp_path / "out", console)
    assert code == 0
    report = json.loads((tmp_path / "out" / "calibration.json").read_text())
    assert report["injection_win_rate"] == win_rate
    assert report["injection_clean_win_rate"] == 0.0  # before the plea: never on top
    assert report["pairwise_accuracy"] == 1.0
    printed = console.export_text()
    assert "win rate before the plea" in printed and "win rate with the plea" in printed
    assert ("would be rewarded" in printed) == (win_rate > cal.INJECTION_WARN)
