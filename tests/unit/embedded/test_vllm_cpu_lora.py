"""The CPU LoRA ops of embedded/vllm_cpu_lora.py against vLLM's own torch ops.

Where every token names an adapter, ours must give vLLM's numbers; a token marked -1 (no
adapter) must get no delta at all, where vLLM's op applies the last slot's adapter. The plugin
against the real vLLM, with real adapters in a mixed batch, is tested in
tests/integration/test_proxy_openai.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from embedded import vllm_cpu_lora as ours

lora_ops = pytest.importorskip("vllm.lora.ops.torch_ops.lora_ops")
# vLLM's own functions, kept before any register() could replace them.
ORIGINAL = {name: getattr(lora_ops, name) for name in ours.REPLACEMENTS}

SLOTS, IN, OUT, RANK = 4, 24, 40, 8


def weights(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def shrink_args(indices: list[int]) -> tuple[torch.Tensor, ...]:
    x = weights((len(indices), IN), 1)
    lora_a = weights((SLOTS, 1, RANK, IN), 2)
    return x, lora_a, torch.zeros(len(indices), RANK), torch.tensor(indices)


def expand_args(indices: list[int], out: int = OUT) -> tuple[torch.Tensor, ...]:
    x = weights((len(indices), RANK), 3)
    lora_b = weights((SLOTS, 1, out, RANK), 4)
    return x, lora_b, weights((len(indices), out), 5), torch.tensor(indices)


def run(op: Callable[..., None], args: tuple[torch.Tensor, ...], *rest: object) -> torch.Tensor:
    out = args[2].clone()
    op(args[0], args[1], out, args[3], *rest)
    return out


VALID = [[2] * 5, [0, 3, 3, 1, 0, 2], [1]]


@pytest.mark.parametrize("indices", VALID)
def test_shrink_matches_vllm_where_every_token_has_an_adapter(indices: list[int]) -> None:
    args = shrink_args(indices)
    expected = run(ORIGINAL["bgmv_shrink"], args, 0.5)
    torch.testing.assert_close(run(ours.bgmv_shrink, args, 0.5), expected)


@pytest.mark.parametrize("indices", VALID)
@pytest.mark.parametrize("add_inputs", [True, False])
def test_expand_matches_vllm_where_every_token_has_an_adapter(
    indices: list[int], add_inputs: bool
) -> None:
    args = expand_args(indices)
    expected = run(ORIGINAL["bgmv_expand"], args, add_inputs)
    torch.testing.assert_close(run(ours.bgmv_expand, args, add_inputs), expected)
    # the slice variant writes columns [8, 8 + OUT) of a wider output
    wide = (args[0], args[1], weights((len(indices), OUT + 16), 6), args[3])
    expected = run(ORIGINAL["bgmv_expand_slice"], wide, 8, OUT, add_inputs)
    torch.testing.assert_close(run(ours.bgmv_expand_slice, wide, 8, OUT, add_inputs), expected)


def test_expand_keeps_vllms_padding_rules() -> None:
    # a single input row broadcast to every output row, and an adapter wider than the output
    args = expand_args([1], out=OUT + 8)
    out = weights((3, OUT), 7)
    wider = (args[0], args[1], out, args[3])
    torch.testing.assert_close(
        run(ours.bgmv_expand, wider, True), run(ORIGINAL["bgmv_expand"], wider, True)
    )


def test_a_token_without_an_adapter_gets_no_delta() -> None:
    indices = [0, -1, 3, -1, -1]
    base_rows = torch.tensor([1, 3, 4])
    args = shrink_args(indices)
    shrunk = run(ours.bgmv_shrink, args, 1.0)
    assert torch.equal(shrunk[base_rows], torch.zeros(3, RANK))
    # vLLM's op reads slot -1, the last adapter, for them: the bug this plugin exists for
    assert run(ORIGINAL["bgmv_shrink"], args, 1.0)[base_rows].abs().sum() > 0

    args = expand_args(indices)
    before = args[2]
    added = run(ours.bgmv_expand, args, True)
    assert torch.equal(added[base_rows], before[base_rows])  # nothing added
    assert torch.equal(run(ours.bgmv_expand, args, False)[base_rows], torch.zeros(3, OUT))
    # and the tokens with adapters are exactly what they would be in a batch of their own
    alone = (args[0][[0, 2]], args[1], before[[0, 2]], torch.tensor([0, 3]))
    torch.testing.assert_close(added[[0, 2]], run(ORIGINAL["bgmv_expand"], alone, True))


def test_an_all_base_batch_is_untouched() -> None:
    args = expand_args([-1, -1])
    assert torch.equal(run(ours.bgmv_expand, args, True), args[2])


def test_register_replaces_the_ops_where_vllm_bound_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.lora.ops import torch_ops
    from vllm.lora.punica_wrapper import punica_cpu

    modules = (lora_ops, torch_ops, punica_cpu)
    for module in modules:  # restored after the test, whatever register() does
        for name in ours.REPLACEMENTS:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, getattr(module, name))
    ours.register()
    ours.register()  # vLLM may load a plugin more than once
    assert punica_cpu.bgmv_shrink is ours.bgmv_shrink
    assert punica_cpu.bgmv_expand_slice is ours.bgmv_expand_slice
    assert lora_ops.bgmv_expand is ours.bgmv_expand  # what lora_ops.sgmv_expand calls
    # the prefill op, through the patched module, now skips -1 tokens too
    x, lora_b, out, _ = expand_args([0, 0, 0])
    before = out.clone()
    lora_ops.sgmv_expand(
        x, lora_b, out, torch.tensor([0, 2]), torch.tensor([2, 1]), torch.tensor([-1, 1]),
        2, 2, 3, True,
    )  # fmt: skip
    assert torch.equal(out[:2], before[:2]) and not torch.equal(out[2], before[2])


def test_the_entry_point_is_installed() -> None:
    from importlib.metadata import entry_points

    found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert found.get(ours.PLUGIN_NAME) == "embedded.vllm_cpu_lora:register"
