"""Does GRPO with our learner visibly improve SmolLM2-135M-Instruct on the demo task, and how fast?

Run it from the repository root (CPU, the embedded model; needs no Kafka or Redis)::

    .venv/bin/python bench/demo_learning.py --config shipped --rounds 2

``--task sorting`` (any of ``tasks.TASKS``) uses that task's prompts and verifier instead
of the demo's; ``--base-only`` then measures a task's base rates (greedy mean, and the spread of
``--base-groups`` groups sampled at the config's temperature).

Method
------
One vLLM (the embedded stack's CPU build, started by ``embedded.stack.vllm_part`` on a free port,
its adapter store in a temporary ``RATCHET_HOME``) serves the base model and every candidate
through the filesystem resolver as ``<alias>@v<N>``. The shipped demo prompts
(``tasks.demo.load_prompts``) are split: the last ``--heldout`` are never trained on. For each
``--config`` (see ``CONFIGS``: ``shipped`` is the demo alias and learner section of the packaged
``embedded/ratchet.yaml``, read from it; ``--set key=value`` overrides a field), from a fresh
LoRA, each round:

1. sample: ``groups`` training prompts (the next ones of a seeded shuffle), ``k`` answers each
   from the live version (v0 = the base, then the previous round's candidate: on-policy), in one
   vLLM chat call per prompt with ``n=k``, ``logprobs`` and ``return_token_ids`` (the judge's own
   ``sampling_body`` and ``parse_group``) and a fixed ``seed`` per request;
2. score: ``tasks.demo.extraction_reward`` (or ``strict_reward``) through
   ``ratchet.rewards.verifiers.run_verifier``, into ``ScoredGroup`` records;
3. train: ``LoraGRPOLearner.train_round``, then ``save_candidate`` as ``<alias>@v<round>``;
4. evaluate (not part of the round's time): every held-out prompt answered greedily
   (temperature 0) by the candidate and scored by the shipped verifier, paired with the base's
   greedy answer: mean score of each, and the win rate (candidate better 1, tie 0.5, worse 0) with
   a 95% percentile-bootstrap interval over prompts (``BOOTSTRAP_SAMPLES``
   resamples, seeded; the gate's own functions from learner/gate.py). ``strict`` is the
   share of held-out answers that are one JSON object and nothing else, scored by fields.

Every phase is timed; the 1-minute load average is recorded with each round (the machine may be
shared). Results go to ``--out`` (default ``bench/results/demo_learning.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import orjson
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedded.config import default_config_text
from embedded.processes import free_port
from judge.sampler import parse_group, sampling_body
from learner.gate_scoring import verifier_outcome
from ratchet.evaluation import bootstrap_interval
from ratchet.records import ScoredGroup
from ratchet.rewards.ruler import strip_code_fence
from ratchet.rewards.verifiers import Verifier, run_verifier
from ratchet.secrets import vllm_api_key
from ratchet.settings import AliasConfig, LearnerSettings, RatchetSettings
from tasks import TASKS, demo, get_task, request_fields
from tasks.demo import expected_fields, extraction_reward

BASE = "smollm2-135m-instruct"
T = TypeVar("T")


@dataclass(frozen=True)
class Config:
    """One round's settings."""

    lr: float
    rank: int
    alpha: int
    k: int
    groups: int
    steps: int
    max_tokens: int
    temperature: float
    scale_rewards: str
    reward: str  # the training reward: "shipped" (tasks.demo) or "strict"
    seed: int
    epochs: int  # passes over a round's groups (learner.epochs_per_round)
    epoch_max_kl: float  # learner.epoch_max_kl
    epoch_max_clip: float  # learner.epoch_max_clip_frac


def shipped_settings() -> tuple[LearnerSettings, AliasConfig]:
    """The learner section and the demo alias of the packaged ratchet.yaml (what `ratchet up`
    writes), over the code's defaults, without this machine's RATCHET_* variables."""
    data = yaml.safe_load(default_config_text())
    return LearnerSettings(**data.get("learner", {})), AliasConfig(**data["aliases"]["demo"])


SHIPPED_LEARNER, SHIPPED_DEMO = shipped_settings()
SHIPPED = Config(
    lr=SHIPPED_LEARNER.learning_rate,
    rank=SHIPPED_LEARNER.lora.rank,
    alpha=SHIPPED_LEARNER.lora.alpha,
    k=SHIPPED_DEMO.learning.group_size,
    groups=SHIPPED_LEARNER.batch_groups,
    steps=SHIPPED_LEARNER.steps_per_round,
    # Automatic by default (the served answers' lengths); demo answers are under 64 tokens.
    max_tokens=SHIPPED_DEMO.sampling.max_tokens or 64,
    temperature=SHIPPED_DEMO.sampling.temperature,
    scale_rewards=SHIPPED_LEARNER.loss.scale_rewards,
    reward="shipped",
    seed=SHIPPED_LEARNER.seed,
    epochs=SHIPPED_LEARNER.epochs_per_round,
    epoch_max_kl=SHIPPED_LEARNER.epoch_max_kl,
    epoch_max_clip=SHIPPED_LEARNER.epoch_max_clip_frac,
)
CONFIGS: dict[str, Config] = {
    "shipped": SHIPPED,
    # What was measured on the way to it (2 cores; held-out score of the base 0.49):
    "half": replace(SHIPPED, groups=16, steps=8),  # round 1 0.57, round 2 0.61
    "half-t1.0": replace(SHIPPED, groups=16, steps=8, temperature=1.0),  # 0.57, then 0.45
    "strict": replace(SHIPPED, reward="strict"),  # format-only reward, for comparison
    # Up to three passes over each round's groups, stopped on KL or clipping (docs/learner.md,
    # levers), and three whole passes.
    "epochs3": replace(SHIPPED, epochs=3),
    "epochs3-whole": replace(SHIPPED, epochs=3, epoch_max_kl=1e9, epoch_max_clip=1.0),
}


def strict_reward(prompt_messages: list[dict[str, Any]], sample: dict[str, Any]) -> float:
    """The share of fields right, and 0 for anything but one JSON object (a fence is fine)."""
    expected_fields(prompt_messages)  # a prompt it does not know raises, whatever the answer
    content = sample.get("content")
    try:
        answer = json.loads(strip_code_fence(content if isinstance(content, str) else ""))
    except (ValueError, RecursionError):
        return 0.0
    if not isinstance(answer, dict):
        return 0.0
    # the shipped verifier gives the object alone FORMAT_WEIGHT plus the rest times the share
    weight = getattr(demo, "FORMAT_WEIGHT", 0.0)
    shipped = extraction_reward(prompt_messages, {"content": json.dumps(answer)})
    return round((shipped - weight) / (1.0 - weight), 9)


REWARDS: dict[str, Verifier] = {"shipped": extraction_reward, "strict": strict_reward}

# vLLM's CPU build kills its engine on a seeded request whose prefill is split over two steps
# ("CPU Generator does not use offset"). Its step budget is 2048 tokens, so the prefill in flight
# (k copies of each prompt) is kept under it.
PREFILL_BUDGET = 1600
PROMPT_TOKENS = 90  # the longest demo prompt is about this long


class VLLM:
    """The embedded stack's vLLM part alone, restarted when it dies under a phase, which is then
    run again (requests are seeded or greedy, so a re-run gives the same answers)."""

    def __init__(self, home: Path, model_path: Path, threads: int, dtype: str | None) -> None:
        from embedded.processes import Stack
        from embedded.stack import vllm_part

        self.url = f"http://127.0.0.1:{free_port()}"
        settings = RatchetSettings(vllm_url=self.url, home=home)
        self.headers = vllm_headers(settings)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        part = vllm_part(settings, model_path, BASE)
        if dtype:  # the embedded stack serves float32, as the learner computes
            part.command += ["--dtype", dtype]
        self.stack = Stack([part], home / "state")
        self.restarts = 0

    def start(self) -> float:
        t0 = time.perf_counter()
        self.stack.start()
        return time.perf_counter() - t0

    def stop(self) -> None:
        self.stack.stop()

    def healthy(self) -> bool:
        from embedded.processes import http_ok

        return self.stack.part("vllm").running and http_ok(self.url + "/health")

    def run(self, make: Callable[[], Awaitable[T]], attempts: int = 4) -> T:
        for attempt in range(attempts):
            try:
                return asyncio.run(make())  # type: ignore[arg-type]
            except (aiohttp.ClientError, RuntimeError, OSError, TimeoutError) as exc:
                if attempt == attempts - 1 or self.healthy():
                    raise
                print(f"vLLM died ({str(exc)[:100]}); restarting", flush=True)
                self.stop()
                self.restarts += 1
                self.start()
        raise AssertionError("unreachable")


def vllm_headers(settings: RatchetSettings) -> dict[str, str]:
    """What a direct call to the stack's vLLM sends: it requires its key on every route."""
    return {"Authorization": f"Bearer {vllm_api_key(settings)}"}


async def chat(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    async with session.post(
        url + "/v1/chat/completions",
        data=orjson.dumps(body),
        headers={"Content-Type": "application/json", **(headers or {})},
        timeout=aiohttp.ClientTimeout(total=900),
    ) as resp:
        payload = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"vLLM {resp.status}: {payload[:300]!r}")
        return orjson.loads(payload)


async def sample_groups(
    url: str,
    served: str,
    version: int,
    alias: str,
    prompts: list[dict[str, Any]],
    cfg: Config,
    seed: int,
    headers: dict[str, str] | None = None,
    verifier: Verifier | None = None,
) -> list[ScoredGroup]:
    """``verifier`` (another task's) replaces ``cfg.reward``."""
    from ratchet.settings import SamplingConfig

    sampling = SamplingConfig(temperature=cfg.temperature, max_tokens=cfg.max_tokens)
    reward = verifier or REWARDS[cfg.reward]
    limit = asyncio.Semaphore(max(1, PREFILL_BUDGET // (cfg.k * PROMPT_TOKENS)))

    async with aiohttp.ClientSession() as session:

        async def one(i: int, prompt: dict[str, Any]) -> ScoredGroup:
            extras = request_fields(prompt)  # a tool task's tools travel with its prompt
            body = sampling_body(served, prompt["messages"], extras, cfg.k, sampling, seed + i)
            async with limit:
                group = parse_group(await chat(session, url, body, headers), cfg.k)
            rewards = [run_verifier(reward, prompt["messages"], s.message) for s in group.samples]
            return ScoredGroup(
                group_id=f"{alias}-{seed}-{i}",
                alias=alias,
                version=version,
                response_model=served,
                prompt_messages=prompt["messages"],
                tools=prompt.get("tools"),
                prompt_token_ids=group.prompt_token_ids,
                samples=group.samples,
                rewards=rewards,
                traffic_request_id=f"demo-{seed}-{i}",
            )

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


@dataclass
class Eval:
    scores: list[float]  # the task's verifier
    strict: list[float]  # strict_reward for the demo, else the same as scores
    texts: list[str]
    seconds: float = 0.0


async def evaluate(
    url: str,
    served: str,
    prompts: list[dict[str, Any]],
    max_tokens: int,
    headers: dict[str, str] | None = None,
    verifier: Verifier = extraction_reward,
    strict: Verifier | None = strict_reward,
    concurrency: int = 16,
) -> Eval:
    """Greedy answers scored by ``verifier`` (the demo's by default): no seed is needed (nor
    given, see PREFILL_BUDGET). ``strict`` is a second score; None: the same as the first."""
    limit = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as session:

        async def one(prompt: dict[str, Any]) -> dict[str, Any]:
            body = {
                "model": served,
                "messages": prompt["messages"],
                "temperature": 0.0,
                "max_tokens": max_tokens,
                **request_fields(prompt),
            }
            async with limit:
                data = await chat(session, url, body, headers)
            return data["choices"][0]["message"]

        messages = await asyncio.gather(*(one(p) for p in prompts))
    scores = [
        run_verifier(verifier, p["messages"], m) for p, m in zip(prompts, messages, strict=True)
    ]
    return Eval(
        scores,
        scores
        if strict is None
        else [strict(p["messages"], m) for p, m in zip(prompts, messages, strict=True)],
        [m.get("content") or "" for m in messages],
        time.perf_counter() - t0,
    )


# Resamples for the held-out win rate's interval (the gate itself now decides sequentially).
BOOTSTRAP_SAMPLES = 2000


def win_rate(cand: list[float], base: list[float], seed: int = 0) -> tuple[float, float, float]:
    """The gate's own statistic: paired win rate (better 1, tie 0.5, worse 0) and its 95%
    percentile-bootstrap interval (learner/gate.py)."""
    wins = [verifier_outcome(c, b) for c, b in zip(cand, base, strict=True)]
    low, high = bootstrap_interval(wins, samples=BOOTSTRAP_SAMPLES, seed=seed)
    return statistics.fmean(wins), low, high


def group_stats(groups: list[ScoredGroup]) -> dict[str, float]:
    rewards = [r for g in groups for r in g.rewards]
    return {
        "train_reward": statistics.fmean(rewards),
        "within_group_std": statistics.fmean(statistics.pstdev(g.rewards) for g in groups),
        "informative_share": statistics.fmean(
            1.0 if max(g.rewards) > min(g.rewards) else 0.0 for g in groups
        ),
        "completion_tokens": statistics.fmean(len(s.token_ids) for g in groups for s in g.samples),
        "truncated_share": statistics.fmean(
            1.0 if s.finish_reason == "length" else 0.0 for g in groups for s in g.samples
        ),
    }


def run_config(
    name: str,
    cfg: Config,
    vllm: VLLM,
    store: Any,
    model_path: Path,
    train: list[dict[str, Any]],
    base: Eval,
    heldout: list[dict[str, Any]],
    rounds: int,
    verifier: Verifier | None = None,
    strict: Verifier | None = strict_reward,
) -> list[dict[str, Any]]:
    """``verifier`` and ``strict``: another task's (see :func:`main`); None: the demo's."""
    import torch

    from learner.trainer import LoraGRPOLearner

    alias = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-") or "demo"
    # The shipped learner settings with this config's knobs: everything else as shipped.
    settings = LearnerSettings(
        **{
            **SHIPPED_LEARNER.model_dump(),
            "learning_rate": cfg.lr,
            "lora": {**SHIPPED_LEARNER.lora.model_dump(), "rank": cfg.rank, "alpha": cfg.alpha},
            "steps_per_round": cfg.steps,
            "loss": {**SHIPPED_LEARNER.loss.model_dump(), "scale_rewards": cfg.scale_rewards},
            "seed": cfg.seed,
            "epochs_per_round": cfg.epochs,
            "epoch_max_kl": cfg.epoch_max_kl,
            "epoch_max_clip_frac": cfg.epoch_max_clip,
        }
    )
    learner = LoraGRPOLearner(
        model_path,
        settings.lora,
        settings,
        device="cpu",
        dtype=torch.float32,
    )
    order = list(range(len(train)))
    random.Random(cfg.seed).shuffle(order)
    rows = []
    served, version = BASE, 0
    for rnd in range(1, rounds + 1):
        start = (rnd - 1) * cfg.groups
        picked = [train[order[(start + i) % len(train)]] for i in range(cfg.groups)]
        seed = cfg.seed * 100_000 + rnd * 1000
        t0 = time.perf_counter()
        groups = vllm.run(
            lambda p=picked, s=seed, v=served, n=version: sample_groups(
                vllm.url, v, n, alias, p, cfg, s, vllm.headers, verifier
            )
        )
        t1 = time.perf_counter()
        stats = learner.train_round(groups)
        t2 = time.perf_counter()
        learner.save_candidate(store, alias, rnd, version, {"demo_config": asdict(cfg)})
        served, version = f"{alias}@v{rnd}", rnd
        t3 = time.perf_counter()
        cand = vllm.run(
            lambda v=served: evaluate(
                vllm.url,
                v,
                heldout,
                cfg.max_tokens,
                vllm.headers,
                verifier or extraction_reward,
                strict,
            )
        )
        rate, low, high = win_rate(cand.scores, base.scores)
        row = {
            "config": name,
            "round": rnd,
            **group_stats(groups),
            "sample_s": t1 - t0,
            "train_s": t2 - t1,
            "save_s": t3 - t2,
            "round_s": t3 - t0,
            "eval_s": cand.seconds,
            "load_avg": os.getloadavg()[0],
            "base_heldout": statistics.fmean(base.scores),
            "cand_heldout": statistics.fmean(cand.scores),
            "base_strict": statistics.fmean(base.strict),
            "cand_strict": statistics.fmean(cand.strict),
            "win_rate": rate,
            "win_low": low,
            "win_high": high,
            "loss": stats.loss,
            "ratio_mean": stats.ratio_mean,
            "ratio_min": stats.ratio_min,
            "ratio_max": stats.ratio_max,
            "clip_frac": stats.clip_frac_low + stats.clip_frac_high,
            "approx_kl": stats.approx_kl,
            "steps": stats.steps,
            "epochs": stats.epochs,
            "stopped": stats.stopped,
            "grad_norm": stats.grad_norm,
            "groups_skipped": stats.groups_skipped,
            "vllm_restarts": vllm.restarts,
            "example": cand.texts[0],
        }
        rows.append(row)
        shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
        print(json.dumps(shown), flush=True)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "| config | round | round s (sample + train) | train reward | held-out base -> cand "
        "| strict base -> cand | win rate [95% CI] |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['config']} | {r['round']} | {r['round_s']:.0f} ({r['sample_s']:.0f} + "
            f"{r['train_s']:.0f}) | {r['train_reward']:.2f} | {r['base_heldout']:.2f} -> "
            f"{r['cand_heldout']:.2f} | {r['base_strict']:.2f} -> {r['cand_strict']:.2f} "
            f"| {r['win_rate']:.2f} [{r['win_low']:.2f}, {r['win_high']:.2f}] |"
        )


def plot(results: dict[str, Any], path: Path) -> None:
    """Held-out score per round, one line per config, the base as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in results["configs"]:
        rows = [r for r in results["rows"] if r["config"] == name]
        ax.plot(
            [0] + [r["round"] for r in rows],
            [rows[0]["base_heldout"] if rows else None] + [r["cand_heldout"] for r in rows],
            marker="o",
            label=name,
        )
    for base in results["base"].values():
        ax.axhline(base["heldout"], linestyle="--", color="grey", label="base (greedy)")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("round (0: the base)")
    ax.set_ylabel("held-out verifier score (greedy)")
    ax.set_title("GRPO on the demo task, SmolLM2-135M-Instruct on CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    types = {f.name: type(getattr(SHIPPED, f.name)) for f in fields(Config)}
    out: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in types:
            raise SystemExit(f"--set {item}: no field {key!r}; fields are {sorted(types)}")
        out[key] = types[key](value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--config", action="append", default=[], help=f"of {sorted(CONFIGS)}")
    parser.add_argument("--set", action="append", default=[], help="field=value, every config")
    parser.add_argument(
        "--task", default="demo", help=f"of {sorted(TASKS)} (its prompts and verifier)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--heldout", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument(
        "--vllm-dtype", default=None, help="e.g. bfloat16 (default: the embedded stack's float32)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/demo_learning.json"))
    parser.add_argument(
        "--base-only", action="store_true", help="only score the base: greedy and one round"
    )
    parser.add_argument("--base-groups", type=int, default=16, help="groups --base-only samples")
    args = parser.parse_args()

    import torch

    from embedded.model import prepare_model
    from ratchet.settings import default_home
    from ratchet.store import AdapterStore

    torch.set_num_threads(args.threads)
    model_path = args.model_path or prepare_model(default_home(), quiet=True)
    task = get_task(args.task)
    prompts = task.load_prompts()
    # The demo keeps its own two scores; another task is scored by its verifier alone.
    verifier = extraction_reward if task.name == "demo" else task.reward()
    strict = strict_reward if task.name == "demo" else None
    train, heldout = prompts[: -args.heldout], prompts[-args.heldout :]
    overrides = parse_overrides(args.set)
    names = args.config or ["shipped"]
    results: dict[str, Any] = {"configs": {}, "rows": [], "base": {}}
    with tempfile.TemporaryDirectory(prefix="ratchet-demo-") as tmp:
        home = Path(tmp)
        vllm = VLLM(home, model_path, args.threads, args.vllm_dtype)
        print(f"vLLM up in {vllm.start():.0f}s at {vllm.url}", flush=True)
        try:
            store = AdapterStore(home / "adapters")
            base_evals: dict[int, Eval] = {}
            for name in names:
                cfg = replace(CONFIGS[name], **overrides)
                results["configs"][name] = asdict(cfg)
                if cfg.max_tokens not in base_evals:
                    base = vllm.run(
                        lambda c=cfg: evaluate(
                            vllm.url, BASE, heldout, c.max_tokens, vllm.headers, verifier, strict
                        )
                    )
                    base_evals[cfg.max_tokens] = base
                    results["base"][cfg.max_tokens] = {
                        "heldout": statistics.fmean(base.scores),
                        "strict": statistics.fmean(base.strict),
                        "seconds": base.seconds,
                    }
                    print(f"base greedy, max_tokens {cfg.max_tokens}: {results['base']}")
                if args.base_only:
                    groups = vllm.run(
                        lambda c=cfg: sample_groups(
                            vllm.url,
                            BASE,
                            0,
                            task.name,
                            train[: args.base_groups],
                            c,
                            1,
                            vllm.headers,
                            verifier,
                        )
                    )
                    print(name, json.dumps(group_stats(groups)))
                    print("greedy examples:", json.dumps(base_evals[cfg.max_tokens].texts[:3]))
                    for g in groups[:2]:
                        print(g.prompt_messages[-1]["content"].rpartition("\n\n")[2])
                        for s, r in zip(g.samples, g.rewards, strict=True):
                            print(f"  {r:.2f} {s.text[:100]!r}")
                    continue
                results["rows"] += run_config(
                    name,
                    cfg,
                    vllm,
                    store,
                    model_path,
                    train,
                    base_evals[cfg.max_tokens],
                    heldout,
                    args.rounds,
                    verifier,
                    strict,
                )
        finally:
            vllm.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print_table(results["rows"])
    if results["rows"]:
        plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and its plot")


if __name__ == "__main__":
    main()
