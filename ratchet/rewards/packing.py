"""Several answers to one prompt as ONE row, the prompt computed once.

A group's K answers share their prompt, so a row holds the prompt once and every answer after
it::

    row:       p0 p1 p2 | a0 a1 a2 | b0 b1 | c0 c1 c2 c3 | pad pad
    segment:    0  0  0 |  1  1  1 |  2  2 |  3  3  3  3 |  -1  -1
    position:   0  1  2 |  3  4  5 |  3  4 |  3  4  5  6 |   0   0

Under :func:`shared_prompt_mask` a token sees the prompt and the earlier tokens of its own answer,
never another answer's, and each answer's positions start where the prompt ends: every answer
token's hidden state is exactly what it is in its own (prompt + answer) sequence. The learner
trains on such rows (learner/batch.py) and the reward model scores them
(ratchet/rewards/reward_model.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

PROMPT_SEGMENT, PAD_SEGMENT = 0, -1


@dataclass
class SharedPromptRows:
    """Rows of (prompt, answers); every (R, T) tensor is aligned with ``input_ids``."""

    input_ids: Tensor  # (R, T) long, right-padded
    position_ids: Tensor  # (R, T) long: each answer continues from the prompt's end
    segment_ids: Tensor  # (R, T) long: 0 prompt, k + 1 the k-th answer, -1 padding
    answer_ends: list[list[int]]  # per row, the position of each answer's last token
    lengths: Tensor  # (R,) long: tokens in the row


def row_layout(
    prompt: Sequence[int], answers: Sequence[Sequence[int]]
) -> tuple[list[int], list[int], list[int]]:
    """(tokens, positions, segments) of one row."""
    p = len(prompt)
    row, positions, segments = list(prompt), list(range(p)), [PROMPT_SEGMENT] * p
    for k, answer in enumerate(answers):
        row += answer
        positions += range(p, p + len(answer))
        segments += [k + 1] * len(answer)
    return row, positions, segments


def padded(values: Sequence[Sequence[int]], fill: int) -> Tensor:
    """(len(values), longest) long tensor, right-padded with ``fill``."""
    width = max((len(v) for v in values), default=0)
    out = torch.full((len(values), width), fill, dtype=torch.long)
    for i, v in enumerate(values):
        out[i, : len(v)] = torch.tensor(list(v), dtype=torch.long)
    return out


def pack_shared_prompt(
    prompts: Sequence[Sequence[int]],
    answers: Sequence[Sequence[Sequence[int]]],
    pad_token_id: int = 0,
) -> SharedPromptRows:
    """One row per prompt with its answers. Every prompt and every answer needs a token."""
    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts for {len(answers)} answer lists")
    rows, positions, segments, ends = [], [], [], []
    for prompt, row_answers in zip(prompts, answers, strict=True):
        if not prompt or any(not a for a in row_answers):
            raise ValueError("a prompt or an answer without tokens cannot be packed")
        row, pos, seg = row_layout(prompt, row_answers)
        rows.append(row)
        positions.append(pos)
        segments.append(seg)
        end, row_ends = len(prompt) - 1, []
        for answer in row_answers:
            end += len(answer)
            row_ends.append(end)
        ends.append(row_ends)
    return SharedPromptRows(
        input_ids=padded(rows, pad_token_id),
        position_ids=padded(positions, 0),
        segment_ids=padded(segments, PAD_SEGMENT),
        answer_ends=ends,
        lengths=torch.tensor([len(r) for r in rows], dtype=torch.long),
    )


def shared_prompt_mask(segment_ids: Tensor) -> Tensor:
    """(R, 1, T, T) boolean attention mask, True where query t may attend to key s: s <= t, and
    s is in the prompt or in t's own answer. Padding attends to the prompt (its output is never
    read) and nothing real attends to padding."""
    t = segment_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=segment_ids.device).tril()
    query, key = segment_ids[:, :, None], segment_ids[:, None, :]
    return (causal & ((key == PROMPT_SEGMENT) | (key == query)))[:, None]
