"""A round's micro-batches across devices: data parallel with torch.distributed.

``torchrun --nproc-per-node N ratchet learner`` starts N processes (``learner.devices``: the
chart's learner pod with N GPUs starts it so). Rank 0 is the learner service: it reads Kafka,
gates, writes adapters. Every other rank follows (:func:`follow`): for each round rank 0 sends
it the groups and the adapter the round starts from, and all ranks train together.

With ``learner.sharding: replicate`` (the default) each rank holds the whole model, the same
adapter and the same optimizer state (the base model must fit one device: DDP's setting). A
step's micro-batches are dealt round-robin (the plan is the same on every rank: it is seeded),
each rank back-propagates its own with the weight it has in the step's token mean, and one
all-reduce of the flat LoRA gradient (a sum) gives every rank the gradient one rank would have
computed alone. Clipping and the AdamW step then run on every rank on the same numbers, so the
adapters stay identical without a broadcast; rank 0 saves adapter and optimizer state once. Why
not DistributedDataParallel's wrapper: its per-forward hooks and bucketing serve large models; a
LoRA's gradient is a few MB, reduced once a step, and the token-mean weights must be global,
which its averaging is not.

With ``learner.sharding: fsdp``, for a base that does not fit one device, FSDP2 (:func:`shard`)
splits the decoder layers' weights, the frozen base's, the LoRA's and AdamW's moments, over the
ranks (rank 0 reads the checkpoint and sends each rank its shards: no other rank ever holds the
whole base, in host memory or on its device): each layer's are gathered for its forward and
backward and freed after, and their gradient is reduce-scattered, averaged, in every backward
(the embeddings and LM head, frozen, stay whole on each rank). The micro-batches are dealt the
same way; a rank with fewer than the busiest runs one again at weight zero (FSDP's gathers need
every rank), and each rank's loss is scaled by the number of ranks so the average is the sum.
Clipping and AdamW work on the shards; at the end of a round every rank gathers the whole
adapter and optimizer state (:func:`gathered`), which rank 0 saves in the format one rank
writes.

With ``lora.dropout > 0`` each rank draws its own dropout masks, so the sum is an estimate as
good as one rank's, not the same numbers.

A round's failure ends it alike on every rank: an adapter that fails to load
(:func:`load_on_every_rank`), a training step that fails on one rank (learner/rank_failure.py).
Sharded, the drift's and the fingerprint's forwards run on every rank (learner/sharded_forwards.py).
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from learner.rank_failure import RanksFailed
from ratchet.records import ScoredGroup

log = logging.getLogger(__name__)

# Followers wait for the next round inside a collective; rounds can be hours apart.
WAIT_FOR_ROUND = _dt.timedelta(days=7)
# Within a round the ranks wait for each other only as long as the slowest rank's share of a
# step, or rank 0's drift forward alone (learner/drift.py): a rank that died or hung inside a
# round's collective ends the group after this, not after WAIT_FOR_ROUND (learner/rank_failure.py).
ROUND_COLLECTIVE_TIMEOUT = _dt.timedelta(minutes=30)

_round_group: Any = None  # the round's collectives' group (start_from_env); None: the default


def round_group() -> Any:
    """The process group a round's collectives use: every rank, with
    :data:`ROUND_COLLECTIVE_TIMEOUT`. None (the default group) where the group was joined
    otherwise than by :func:`start_from_env` (the unit tests)."""
    return _round_group


@dataclass(frozen=True)
class Ranks:
    """This process's place among the learner's processes."""

    rank: int = 0
    size: int = 1

    @classmethod
    def current(cls) -> Ranks:
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def mine(self, index: int) -> bool:
        """Whether the ``index``-th micro-batch of a step is this rank's to compute."""
        return index % self.size == self.rank


def start_from_env(device: str) -> Ranks:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1): NCCL on GPUs, with this
    rank's GPU (``LOCAL_RANK``) made the current one, so ``cuda`` means it; gloo on CPUs."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return Ranks()
    use_cuda = device != "cpu" and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=WAIT_FOR_ROUND)
    global _round_group
    _round_group = dist.new_group(timeout=ROUND_COLLECTIVE_TIMEOUT)
    ranks = Ranks.current()
    log.info("learner rank %d of %d (%s)", ranks.rank, ranks.size, "nccl" if use_cuda else "gloo")
    return ranks


def all_reduce_grads(params: Sequence[Tensor], *extra: Tensor) -> list[Tensor]:
    """Sum every parameter's gradient (and ``extra`` scalars) over the ranks, in one collective
    on one flat buffer. A rank that computed no micro-batch of the step adds zeros."""
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads] + [e.reshape(1).to(grads[0]) for e in extra])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=round_group())
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    return [flat[offset + i].to(e.dtype) for i, e in enumerate(extra)]


def all_reduce(values: Tensor, op: str) -> Tensor:
    """``values`` summed (``"sum"``), or their minimum or maximum (``"min"``, ``"max"``: NaN, a
    rank that saw nothing, loses to any number) over the ranks."""
    out = values.clone()
    if op == "sum":
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=round_group())
        return out
    fill = torch.inf if op == "min" else -torch.inf
    out = torch.nan_to_num(out, nan=fill)
    reduce_op = dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX
    dist.all_reduce(out, op=reduce_op, group=round_group())
    return torch.where(torch.isinf(out), torch.full_like(out, torch.nan), out)


# --- FSDP2: the weights sharded over the ranks --------------------------------------------------


def empty_base(path: Path, **load_options: Any) -> nn.Module:
    """The base model's modules without its weights: parameters on the meta device (no memory),
    buffers (the rotary frequencies, which no checkpoint holds) computed as a load computes
    them. What a follower rank builds under ``learner.sharding: fsdp``: rank 0 reads the
    checkpoint and :func:`shard` sends each rank its part, so a follower never holds the whole
    base (accelerate's ``init_empty_weights`` is what transformers itself uses for this).
    ``load_options`` are rank 0's ``from_pretrained`` options, so both build the same model."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):
        model: Any = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, **load_options
        )
    model.tie_weights()  # as from_pretrained does: a tied head is the embeddings' parameter
    return cast(nn.Module, model)


def shard(model: nn.Module, blocks: Sequence[str], device: torch.device) -> None:
    """Shard ``model`` over the ranks with FSDP2: each module whose class is named in ``blocks``
    (a transformers model's ``_no_split_modules``: its decoder layers, nearly all of a large
    model's weights) is one unit, gathered for its own forward and backward. The rest (the
    embeddings, the last norm, the LM head) stays whole on every rank: the learner calls the
    backbone and the head apart (learner/batch.py), and a head tied to the embeddings cannot be
    in a unit of its own.

    Rank 0's ``model`` holds the weights (the base read from its checkpoint, the LoRA seeded);
    every other rank's is empty (:func:`empty_base`). Rank 0 sends each tensor in turn and each
    rank keeps its shard of it (``set_model_state_dict`` with ``broadcast_from_rank0``, torch's
    own), so a follower holds its shards and the whole tensors outside the units, never the
    whole base."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    group = round_group()  # the gathers and reduce-scatters are a round's collectives
    if group is None:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    else:
        mesh = DeviceMesh.from_group(group, device.type)
    names = set(blocks)
    units = [m for m in model.modules() if type(m).__name__ in names]
    if not units:
        raise ValueError(f"learner.sharding fsdp: no module of the model is one of {sorted(names)}")
    leader = dist.get_rank() == 0
    weights = model.state_dict() if leader else {}  # the whole tensors, kept until they are sent
    for unit in units:
        fully_shard(unit, mesh=mesh)
    if leader:
        model.to(device)  # what no unit holds; the units' shards are there already
    else:
        tied = shared_parameters(model)
        allocate(model, device)
        retie(model, tied)  # before the load: one tensor received for the pair, not two
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, weights, options=options)
    del weights


def allocate(model: nn.Module, device: torch.device) -> None:
    """Room on ``device`` for what an empty model (:func:`empty_base`) will receive, its shards
    only where sharded, uninitialised; its buffers, computed here (no checkpoint holds them),
    moved as they are."""
    buffers = list(model.named_buffers())
    model.to_empty(device=device)
    for name, buffer in buffers:
        set_attribute(model, name, buffer.to(device))


def shared_parameters(model: nn.Module) -> list[list[str]]:
    """The names of each parameter the model holds under several names (a head tied to the
    embeddings), each group in the model's order."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Each group of :func:`shared_parameters` one parameter again, the first name's: moving an
    empty model (:func:`allocate`) gives each name its own."""
    for first, *rest in groups:
        param = model.get_parameter(first)
        for name in rest:
            set_attribute(model, name, param)


def set_attribute(model: nn.Module, name: str, value: Tensor) -> None:
    """Set the tensor a dotted name (``model.embed_tokens.weight``) names."""
    owner, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(owner), attribute, value)


def is_sharded(tensor: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def whole(tensor: Tensor) -> Tensor:
    """A sharded tensor gathered (a collective: every rank calls it), or the tensor itself."""
    sharded: Any = tensor
    return cast(Tensor, sharded.full_tensor()) if is_sharded(tensor) else tensor


def like(full: Tensor, param: Tensor) -> Tensor:
    """``full`` laid out as ``param`` is: this rank's shard of it where ``param`` is sharded."""
    from torch.distributed.tensor import distribute_tensor

    if not is_sharded(param):
        return full.to(param.device)
    sharded: Any = param
    return distribute_tensor(full.to(param.device), sharded.device_mesh, sharded.placements)


def gathered(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's ``state_dict()`` with every sharded tensor gathered whole."""
    state = {
        index: {key: whole(value) for key, value in entry.items()}
        for index, entry in optimizer_state["state"].items()
    }
    return {**optimizer_state, "state": state}


def scattered(optimizer_state: dict[str, Any], params: Sequence[Tensor]) -> dict[str, Any]:
    """A whole optimizer state (:func:`gathered`, or one rank's) laid out as ``params`` are: each
    tensor of a parameter's shape sharded as the parameter is."""
    state = {}
    for index, entry in optimizer_state["state"].items():
        param = params[int(index)]
        state[index] = {
            key: like(value, param) if value.shape == param.shape else value
            for key, value in entry.items()
        }
    return {**optimizer_state, "state": state}


# --- rank 0 leads, the others follow -----------------------------------------------------------


class RoundTrainer(Protocol):
    """What a rank trains a round with (learner/trainer.py's LoraGRPOLearner)."""

    def read_adapter(self, folder: Path | None) -> Any: ...

    def set_adapter(self, read: Any) -> None: ...

    def train_round(self, groups: list[ScoredGroup]) -> Any: ...


class RoundForwards(Protocol):
    """Forward passes a sharded round runs on every rank besides training, as rank 0 runs them
    (learner/sharded_forwards.py): FSDP's forward gathers the weights from every rank."""

    def before(self, trainer: Any, groups: list[ScoredGroup]) -> None: ...

    def after(self, trainer: Any) -> None: ...


class AdapterLoadFailed(RuntimeError):
    """The round's starting adapter did not load on some rank (another rank's error, named): every
    rank raises it, so the round fails alike on all of them and none waits in a collective."""


def send_round(
    groups: list[ScoredGroup], adapter: Path | None, forwards: RoundForwards | None = None
) -> None:
    """Rank 0: the next round's groups, starting adapter (None: a fresh LoRA) and the forwards
    to run with it (None: none) to the others."""
    groups_json = [g.to_json() for g in groups]
    message: list[Any] = [("train", groups_json, adapter and str(adapter), forwards)]
    dist.broadcast_object_list(message, src=0)


def send_stop() -> None:
    dist.broadcast_object_list([("stop", [], None, None)], src=0)


def load_on_every_rank(trainer: RoundTrainer, adapter: Path | None) -> None:
    """Load the round's starting adapter on every rank, in two parts with one agreement between.

    First each rank alone reads it (``read_adapter``: every check of its shape against the
    settings and the model, its weights and optimizer state read into memory; no collective).
    Then one collective every rank joins, failed or not (``all_gather_object``), tells each rank
    whether every rank read it. If one did not, every rank raises before any collective of the
    load: rank 0 its own error when it had one (as one rank alone would, so an outage stays an
    outage), else :class:`AdapterLoadFailed` naming the ranks' errors; the round then fails on
    every rank alike and none waits mid-load. Only when all read it does each rank set it
    (``set_adapter``: sharded, the scatter of the weights and optimizer state, the gather of the
    whole adapter, collectives every rank joins)."""
    own: Exception | None = None
    read: Any = None
    try:
        read = trainer.read_adapter(adapter)
    except Exception as exc:  # told to every rank below; raised again after
        own = exc
    errors: list[str | None] = [None] * dist.get_world_size()
    mine = None if own is None else f"{type(own).__name__}: {own}"
    dist.all_gather_object(errors, mine, group=round_group())
    failed = [f"rank {rank}: {error}" for rank, error in enumerate(errors) if error is not None]
    if failed:
        if own is not None and dist.get_rank() == 0:
            raise own
        raise AdapterLoadFailed(f"adapter {adapter} did not load: " + "; ".join(failed)) from own
    trainer.set_adapter(read)


def lead_round(
    trainer: RoundTrainer,
    groups: list[ScoredGroup],
    adapter: Path | None,
    forwards: RoundForwards | None = None,
) -> None:
    """Rank 0: the round sent to the others, its adapter loaded with them
    (:func:`load_on_every_rank`); the caller then trains it, running ``forwards``' passes
    before and after as the followers do."""
    send_round(groups, adapter, forwards)
    load_on_every_rank(trainer, adapter)


def follow(trainer: RoundTrainer) -> None:
    """A follower's life: each round rank 0 sends, trained alongside it, until it says stop. A
    round whose adapter did not load on some rank is skipped here as rank 0 fails it; one whose
    training failed on some rank (learner/rank_failure.py) ends here at the step it ends on rank
    0. Any other failure ends the process: it happened inside a collective, the ranks are out of
    step, and torchrun restarts the group."""
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0)
        kind, groups, adapter, forwards = message[0]
        if kind == "stop":
            return
        try:
            load_on_every_rank(trainer, Path(adapter) if adapter else None)
        except Exception as exc:
            log.warning("round skipped: %s", exc)
            continue
        scored = [ScoredGroup.model_validate_json(g) for g in groups]
        try:
            if forwards is not None:
                forwards.before(trainer, scored)
            trainer.train_round(scored)
            if forwards is not None:
                forwards.after(trainer)
        except RanksFailed as exc:  # every rank stopped at the same step; rank 0 pauses the alias
            log.warning("round failed: %s", exc)
