"""`ratchet demo`: replay the demo prompts through the proxy as users would, rating each answer."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from ratchet.cli.app import ConfigOption, app, console, settings_or_exit


@app.command()
def demo(
    alias: Annotated[str, typer.Option(help="alias to send the demo prompts to")] = "demo",
    count: Annotated[int, typer.Option(help="prompts to send (the set repeats if larger)")] = 200,
    rounds: Annotated[int, typer.Option(help="times to replay the prompts")] = 1,
    concurrency: Annotated[int, typer.Option(help="requests in flight")] = 4,
    feedback: Annotated[
        bool,
        typer.Option(help="rate each answer with its verifier score via /v1/feedback, as a user"),
    ] = True,
    api_key: Annotated[str, typer.Option(envvar="RATCHET_DEMO_API_KEY")] = "unused",
    config: ConfigOption = None,
) -> None:
    """Replay the bundled demo prompts through the proxy as traffic, and score the answers.

    Prints the demo verifier's mean score per version that answered, so a promotion shows up as
    a new row with a higher score. Each score also goes back as user feedback, which is what a
    canary is judged by.
    """
    import asyncio

    import httpx
    from rich.progress import Progress, TaskID

    from ratchet.demo import extraction_reward, load_prompts

    settings = settings_or_exit(config)
    if alias not in settings.aliases:
        console.print(f"[red]alias {alias!r} is not in ratchet.yaml[/red]")
        raise typer.Exit(2)
    prompts = load_prompts()
    work = [prompts[i % len(prompts)] for i in range(count)] * rounds
    base_url = f"http://{settings.proxy.host}:{settings.proxy.port}/v1"
    scores: dict[str, list[float]] = {}
    failures: list[str] = []

    async def replay(progress: Progress, task: TaskID) -> None:
        import openai

        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=2)
        raters = httpx.AsyncClient(
            base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=30
        )
        limit = asyncio.Semaphore(concurrency)

        async def one(prompt: dict[str, Any]) -> None:
            messages = prompt["messages"]
            async with limit:
                try:
                    raw = await client.chat.completions.with_raw_response.create(
                        model=alias, messages=messages, max_tokens=64, temperature=0.0
                    )
                except openai.OpenAIError as exc:
                    failures.append(str(exc)[:200])
                else:
                    completion = raw.parse()
                    answer = completion.choices[0].message
                    served = raw.headers.get("x-ratchet-served-name", "?")
                    sample = {"role": "assistant", "content": answer.content}
                    score = extraction_reward(messages, sample)
                    scores.setdefault(served, []).append(score)
                    if feedback:
                        rating = {"completion_id": completion.id, "score": score}
                        try:
                            rated = await raters.post("/feedback", json=rating)
                        except httpx.HTTPError as exc:
                            failures.append(f"feedback: {exc}"[:200])
                        else:
                            if rated.status_code != 200:
                                failures.append(f"feedback: {rated.status_code} {rated.text}"[:200])
            progress.advance(task)

        await asyncio.gather(*(one(p) for p in work))
        await client.close()
        await raters.aclose()

    with Progress(console=console) as progress:
        task = progress.add_task(f"Sending demo traffic to {alias}", total=len(work))
        asyncio.run(replay(progress, task))
    table = Table(title=f"{alias}: demo verifier score by version that answered")
    for column in ("served as", "answers", "mean score"):
        table.add_column(column)
    for served, values in sorted(scores.items()):
        table.add_row(served, str(len(values)), f"{sum(values) / len(values):.3f}")
    console.print(table)
    if failures:
        console.print(f"[yellow]{len(failures)} requests failed, e.g. {failures[0]}[/yellow]")
