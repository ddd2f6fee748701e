"""A learner's adapter as files: the LoRA weights and AdamW state a round starts from and
writes (learner/trainer.py trains them).

A candidate is written to the store as peft writes an adapter (``adapter_config.json``,
``adapter_model.safetensors``: what vLLM loads) plus ``optimizer.pt``, the AdamW state, so the
next round, in this process or after a restart, continues where it stopped. A stored adapter of
another shape (rank, alpha, target modules) cannot be continued: loading it is a ValueError.
Sharded over ranks (learner/parallel.py), each rank loads its shards and every rank gathers the
whole adapter after a load and a round, for rank 0 to write it as one rank would.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from learner.parallel import gathered, like, scattered, whole
from learner.round_stats import RoundStats
from ratchet.settings import LearnerSettings, LoraSettings
from ratchet.store import AdapterStore

log = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
STATE_FORMAT = 1


# What a round's training depends on, recorded in each adapter's metadata beside its LoRA shape.
TRAINING_FIELDS = frozenset(
    {
        "learning_rate",
        "steps_per_round",
        "micro_batch_tokens",
        "max_grad_norm",
        "weight_decay",
        "loss",
        "seed",
        "epochs_per_round",
        "epoch_max_kl",
        "epoch_max_clip_frac",
        "precision",
        "sharding",
    }
)


def saved_key(param_name: str, adapter: str = "default") -> str:
    """The key peft saves a LoRA parameter under: its name without the adapter's."""
    return param_name.replace(f".{adapter}", "")


@dataclass(frozen=True)
class ReadAdapter:
    """A stored adapter read into memory and checked (:meth:`AdapterState.read_adapter`): its
    whole weights in the model's parameter order, its optimizer state (None: none that fits)."""

    weights: list[Tensor]
    optimizer: dict[str, Any] | None


def read_optimizer_state(path: Path, device: torch.device) -> dict[str, Any]:
    return cast(dict[str, Any], torch.load(path, map_location=device, weights_only=True))


class AdapterState:
    """The adapter and optimizer state of :class:`learner.trainer.LoraGRPOLearner`: loaded from
    a stored version or fresh, and written as a candidate. The learner sets these attributes."""

    model: Any  # the peft model
    lora: LoraSettings
    train: LearnerSettings
    device: torch.device
    base_model_id: str
    target_modules: tuple[str, ...]
    param_names: list[str]
    params: list[nn.Parameter]
    sharded: bool
    rounds: int
    optimizer_steps: int
    groups_seen: int
    tokens_seen: int
    last_round: RoundStats | None
    optimizer: torch.optim.Optimizer
    _fresh: list[Tensor]
    # Sharded: the whole adapter and optimizer state, gathered by every rank after a load and
    # after a round, for rank 0 to save.
    _whole: tuple[dict[str, Tensor], dict[str, Any]] | None

    def load_adapter(self, folder: Path | None) -> None:
        """Start from a fresh LoRA (None: v0 -> v1) or from a stored version, with its optimizer
        state when the folder has one. The stored adapter's rank, alpha and target modules must
        match the settings: a different shape cannot continue it."""
        self.set_adapter(self.read_adapter(folder))

    def read_adapter(self, folder: Path | None) -> ReadAdapter | None:
        """This rank alone, no collective: every check of a stored adapter and every file of it
        read into memory (None: a fresh LoRA). ValueError if it does not fit the settings or the
        model; an unreadable file raises as the read does. Nothing of the learner changes yet."""
        if folder is None:
            return None
        from safetensors.torch import load_file

        folder = Path(folder)
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
        targets = config.get("target_modules") or []
        targets = [targets] if isinstance(targets, str) else targets
        stored = (config.get("r"), config.get("lora_alpha"), sorted(targets))
        wanted = (self.lora.rank, self.lora.alpha, sorted(self.target_modules))
        if stored != wanted:
            raise ValueError(
                f"{folder.name} has (rank, alpha, targets) {stored}, the settings "
                f"{wanted}; start a fresh adapter to change its shape"
            )
        weights = load_file(folder / ADAPTER_WEIGHTS, device=str(self.device))
        keys = [saved_key(name) for name in self.param_names]
        missing = [k for k in keys if k not in weights]
        unexpected = sorted(set(weights) - set(keys))
        if unexpected or missing:
            raise ValueError(
                f"{folder.name}: adapter weights do not fit the model "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        path = folder / OPTIMIZER_FILE
        state: dict[str, Any] | None = None
        if not path.is_file():
            log.info("%s has no %s: fresh optimizer state", folder.name, OPTIMIZER_FILE)
        else:
            state = read_optimizer_state(path, self.device)
            if state.get("format") != STATE_FORMAT or state.get("param_names") != self.param_names:
                log.warning("%s: optimizer state does not fit this model; starting it fresh", path)
                state = None
        return ReadAdapter([weights[key] for key in keys], state)

    def set_adapter(self, read: ReadAdapter | None) -> None:
        """What :meth:`read_adapter` read (None: a fresh LoRA) made the learner's adapter and
        optimizer state. Sharded, collectives: each rank keeps its shards of what it read, then
        every rank gathers the whole adapter; every rank must call it, after every rank read."""
        self.rounds = self.optimizer_steps = self.groups_seen = self.tokens_seen = 0
        self.last_round = None
        self.optimizer = self._new_optimizer()
        with torch.no_grad():
            tensors = self._fresh if read is None else read.weights
            for tensor, param in zip(tensors, self.params, strict=True):
                param.copy_(tensor if read is None else like(tensor.to(param.dtype), param))
        state = read.optimizer if read is not None else None
        if state is not None:
            self.optimizer.load_state_dict(scattered(state["optimizer"], self.params))
            for group in self.optimizer.param_groups:  # the settings win over the stored values
                group.update(lr=self.train.learning_rate, weight_decay=self.train.weight_decay)
            self.rounds, self.optimizer_steps = int(state["rounds"]), int(state["optimizer_steps"])
            self.groups_seen = int(state["groups_seen"])
            self.tokens_seen = int(state["tokens_seen"])
        if self.sharded:
            self._gather()

    def _gather(self) -> None:
        """Every rank: the whole adapter and optimizer state, kept for :meth:`save_candidate`."""
        weights = {n: whole(p.detach()) for n, p in zip(self.param_names, self.params, strict=True)}
        self._whole = weights, gathered(self.optimizer.state_dict())

    def adapter_weights(self) -> dict[str, Tensor]:
        """The adapter's whole weights by parameter name (sharded: as of the last load or
        round)."""
        if self._whole is not None:
            return dict(self._whole[0])
        return {n: p.detach() for n, p in zip(self.param_names, self.params, strict=True)}

    def _new_optimizer(self) -> torch.optim.Optimizer:
        fused = self.device.type in ("cuda", "cpu")
        return torch.optim.AdamW(
            self.params,
            lr=self.train.learning_rate,
            weight_decay=self.train.weight_decay,
            fused=fused,
        )

    def save_candidate(
        self, store: AdapterStore, alias: str, version: int, parent: int, meta: dict[str, Any]
    ) -> Path:
        """Write the adapter and its optimizer state as ``<alias>@v<version>``, atomically."""

        def write(folder: Path) -> None:
            weights = self.adapter_weights()  # sharded: the whole tensors, not this rank's shard
            self.model.save_pretrained(str(folder), safe_serialization=True, state_dict=weights)
            (folder / "README.md").unlink(missing_ok=True)  # peft's model card stub
            config_path = folder / ADAPTER_CONFIG
            config = json.loads(config_path.read_text())
            config["target_modules"] = sorted(self.target_modules)  # peft writes a set's order
            config_path.write_text(json.dumps(config, indent=2))
            torch.save(self._optimizer_state(), folder / OPTIMIZER_FILE)

        full_meta: dict[str, Any] = {
            "parent_version": parent,
            "rounds": self.rounds,
            "optimizer_steps": self.optimizer_steps,
            "groups_seen": self.groups_seen,
            "completion_tokens_seen": self.tokens_seen,
            "lora": self.lora.model_dump(mode="json"),
            "train": self.train.model_dump(mode="json", include=set(TRAINING_FIELDS)),
            "last_round": self.last_round.as_dict() if self.last_round else None,
        }
        full_meta.update(meta)
        return store.write(alias, version, write, self.base_model_id, full_meta)

    def _optimizer_state(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "param_names": self.param_names,
            "optimizer": self._whole[1] if self._whole else self.optimizer.state_dict(),
            "rounds": self.rounds,
            "optimizer_steps": self.optimizer_steps,
            "groups_seen": self.groups_seen,
            "tokens_seen": self.tokens_seen,
        }
