"""The PAL modules dispatch to the fused kernels and give the reference path's outputs and gradients.

On tests/device.py's DEVICE: off CUDA the Triton kernels run in interpreter mode (``FASTPALS_KERNELS=triton``,
``TRITON_INTERPRET=1``); on a GPU they run compiled.
"""

import copy
import dataclasses
import importlib

import pytest
import torch
from device import DEVICE

from fastpals.encoder.bert import BertConfig, BertModel, PALConfig

pytestmark = pytest.mark.kernels

TINY = BertConfig(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
    max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)  # fmt: skip


def _run(model, mode, monkeypatch, unpad):
    monkeypatch.setenv("FASTPALS_KERNELS", mode)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (4, 11), generator=g).to(DEVICE)
    mask = torch.ones(4, 11, dtype=torch.long, device=DEVICE)
    mask[1, 6:] = 0
    mask[3, 2:] = 0
    tasks = torch.tensor([2, 0, 2, 0], device=DEVICE)  # task 1 has no examples
    model.zero_grad(set_to_none=True)
    out = model(ids, mask, task_ids=tasks, unpad=unpad)
    loss = (out.last_hidden_state * mask[..., None]).pow(2).mean() + out.pooler_output.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.last_hidden_state[mask.bool()], grads


@pytest.mark.parametrize("unpad", [False, True])
@pytest.mark.parametrize(
    "pal",
    [
        PALConfig(num_tasks=3, hidden=34, num_heads=1),  # head dim 34
        PALConfig(num_tasks=3, hidden=34, num_heads=2, gelu=False, gate=True),  # head dim 17, gate
    ],
    ids=["dh34", "dh17_gate"],
)
def test_fused_model_equals_reference(monkeypatch, unpad, pal):
    torch.manual_seed(0)
    model = BertModel(TINY, pal=dataclasses.replace(pal, dropout=0.0)).to(DEVICE).train()
    ref_out, ref_grads = _run(model, "reference", monkeypatch, unpad)
    # the eager PAL path finds the fused op in its module
    pal_module = importlib.import_module("fastpals_kernels.pal")

    name = "pal_varlen" if unpad else "pal"
    fused_op, calls = getattr(pal_module, name), []
    monkeypatch.setattr(pal_module, name, lambda *a, **k: calls.append(1) or fused_op(*a, **k))
    fused_out, fused_grads = _run(copy.deepcopy(model), "triton", monkeypatch, unpad)
    assert len(calls) == TINY.num_hidden_layers, "the PAL modules did not dispatch to the fused kernels"
    torch.testing.assert_close(fused_out, ref_out, atol=1e-5, rtol=1e-5)
    assert ref_grads.keys() == fused_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(fused_grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_auto_mode_uses_reference_on_cpu(monkeypatch):
    import fastpals_kernels as kernels

    monkeypatch.setenv("FASTPALS_KERNELS", "auto")
    assert kernels.use_triton(torch.zeros(1, device="cpu")) is False  # host: the rule for a CPU tensor
