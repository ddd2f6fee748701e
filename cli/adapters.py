"""`ratchet import`: a LoRA adapter trained elsewhere, checked, stored as the alias's next version
and queued for the same gate and canary as a learned candidate (the learner runs them)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from cli.app import AliasArgument, ConfigOption, app, console, settings_or_exit
from ratchet.settings import RatchetSettings

if TYPE_CHECKING:
    from cli.adapter_checks import CheckedAdapter, LoraShape
    from ratchet.lifecycle import Lifecycle

# The round ends the learner writes for an imported version (ratchet/rounds.py's outcomes).
IMPORT_ENDS = ("promote", "canary", "reject")


def base_model_of(settings: RatchetSettings) -> tuple[Path, str]:
    """The base weights' folder and the name adapters give it (vLLM's --model value):
    ``learner.base_model_path``, else the embedded stack's prepared model."""
    from embedded.model import model_dir

    configured = settings.learner.base_model_path
    folder = Path(configured) if configured else model_dir(settings.home)
    if not folder.is_dir():
        console.print(
            f"[red]no base model at {folder}: set learner.base_model_path (or "
            "RATCHET_LEARNER__BASE_MODEL_PATH) to the folder vLLM serves as --model[/red]"
        )
        raise typer.Exit(2)
    return folder, configured or str(folder)


def learner_shape(settings: RatchetSettings, base: Path) -> LoraShape:
    """The (rank, alpha, target modules) the learner trains, "all-linear" resolved on ``base``."""
    from cli.adapter_checks import LoraShape, base_linear_shapes, linear_module_names

    s = settings.learner
    targets = s.lora.target_modules
    if targets == "all-linear":
        names = linear_module_names(base_linear_shapes(base))
    else:
        names = tuple(sorted(set(targets)))
    return LoraShape(s.lora.rank, s.lora.alpha, names)


def copy_adapter(checked: CheckedAdapter, folder: Path) -> None:
    """The two files the store keeps, the config as checked (cli/adapter_config.py: only keys
    vLLM and the learner read the same way); the weights are hashed again after the copy, so a
    file changed since it was checked is not stored."""
    from cli.adapter_checks import ADAPTER_CONFIG, ADAPTER_WEIGHTS, file_sha256

    (folder / ADAPTER_CONFIG).write_text(json.dumps(checked.config, indent=2))
    shutil.copyfile(checked.folder / ADAPTER_WEIGHTS, folder / ADAPTER_WEIGHTS)
    if file_sha256(folder / ADAPTER_WEIGHTS) != checked.sha256:
        raise OSError(f"{ADAPTER_WEIGHTS} changed while it was imported")


def store_import(
    lifecycle: Lifecycle, base_id: str, alias: str, checked: CheckedAdapter
) -> tuple[int, int]:
    """The adapter written as the alias's next version (its base named ``base_id``, vLLM's
    --model), and its ``candidate`` event written with the version queued for the gate, in one
    transaction. Returns (version, live version)."""
    from ratchet.records import utc_now
    from ratchet.versions import next_version, queue_import

    route = lifecycle.route(alias)
    version = next_version(lifecycle.writer.redis, lifecycle.store, alias)
    source = str(checked.folder.resolve())
    meta: dict[str, Any] = {
        "origin": "import",
        "source": source,
        "declared_base": checked.declared_base,
        "sha256": checked.sha256,
        "parent_version": route.active,
        "imported_at": utc_now(),
        "alias": alias,
        "lora": {
            "rank": checked.shape.rank,
            "alpha": checked.shape.alpha,
            "target_modules": list(checked.shape.target_modules),
        },
    }
    lifecycle.store.write(
        alias, version, lambda folder: copy_adapter(checked, folder), base_id, meta
    )
    event = lifecycle.event(
        alias,
        "candidate",
        version=version,
        previous_version=route.active,
        detail={
            "origin": "import",
            "source": source,
            "reason": f"imported from {source}",
            "sha256": checked.sha256,
            "declared_base": checked.declared_base,
        },
    )
    lifecycle.record(event, also=lambda pipe: queue_import(pipe, alias, version))
    return version, route.active


def wait_for_gate(
    lifecycle: Lifecycle, alias: str, version: int, timeout_s: float
) -> dict[str, Any]:
    """The learner's outcome for ``version``, polled from the alias's history."""
    deadline = time.monotonic() + timeout_s
    with console.status(f"waiting for the learner to gate {alias}@v{version}"):
        while time.monotonic() < deadline:
            for event in lifecycle.writer.history(alias, limit=50):
                if event.get("kind") in IMPORT_ENDS and event.get("version") == version:
                    return event
            time.sleep(1.0)
    console.print(
        f"[yellow]no outcome for v{version} in {timeout_s:.0f} s: the learner gates "
        "it once it holds the alias and enough held-out prompts; see ratchet status[/yellow]"
    )
    raise typer.Exit(3)


@app.command("import")
def import_adapter(
    alias: AliasArgument,
    path: Annotated[Path, typer.Argument(help="the PEFT LoRA adapter's folder")],
    wait: Annotated[
        float, typer.Option(help="seconds to wait for the gate's outcome (0: do not wait)")
    ] = 0.0,
    config: ConfigOption = None,
) -> None:
    """Bring in a LoRA adapter trained elsewhere: checked, stored as the next version, then gated
    and canaried by the learner exactly as a learned one."""
    from cli.adapter_checks import ADAPTER_CONFIG, AdapterRefused, check_adapter
    from cli.lifecycle import lifecycle_session

    settings = settings_or_exit(config)
    if alias not in settings.aliases:
        console.print(f"[red]unknown alias {alias!r}: add it to ratchet.yaml first[/red]")
        raise typer.Exit(2)
    base, base_id = base_model_of(settings)
    try:
        checked = check_adapter(path, base, learner_shape(settings, base))
    except AdapterRefused as exc:
        console.print(f"[red]refused: {exc}[/red]")
        raise typer.Exit(1) from None
    with lifecycle_session(settings, alias) as lifecycle:
        version, live = store_import(lifecycle, base_id, alias, checked)
        if checked.ignored_files:
            console.print(f"not imported (never read): {', '.join(checked.ignored_files)}")
        if checked.dropped_keys:
            dropped = ", ".join(checked.dropped_keys)
            console.print(
                f"{ADAPTER_CONFIG} keys not kept (neither vLLM nor the learner reads them): "
                f"{dropped}"
            )
        console.print(
            f"{alias}: imported as v{version} ({checked.tensors} tensors, sha256 "
            f"{checked.sha256[:12]}); the learner gates it against v{live}"
        )
        if wait > 0:
            outcome = wait_for_gate(lifecycle, alias, version, wait)
            detail = outcome.get("detail") or {}
            reason = detail.get("reason") or (detail.get("gate") or {}).get("reason", "")
            console.print(f"{alias}: v{version} {outcome['kind']}: {reason}")
