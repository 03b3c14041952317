"""The residual + dropout + LayerNorm op (fastpals_kernels.dropout_layer_norm): its Triton kernels against a float64
transcription and the same-dtype PyTorch reference, on tests/device.py's DEVICE (off CUDA in Triton's
interpreter): forward and every gradient without dropout; with dropout the kept fraction, the backward's mask
being the forward's (read back from the output), determinism for a seed; fake tensors, opcheck, bad inputs; the
model's sublayers through the op.

Rule (flash-attention's, tests/tolerances.py): the kernel's error against float64 is at most twice the same-dtype
PyTorch reference's, plus a floor of 1e-6 of the largest float64 value; fp32 within 1e-5 of the reference.
"""

from __future__ import annotations

import copy

import pytest
import torch
from device import DEVICE
from tolerances import assert_close_to_reference, assert_fp32_close
from torch._subclasses.fake_tensor import FakeTensorMode

from fastpals.encoder import bert
from fastpals.encoder.bert import BertConfig, BertModel
from fastpals_kernels.dropout import dropout_add
from fastpals_kernels.dropout_layer_norm import dropout_add_layer_norm, dropout_add_layer_norm_reference

pytestmark = pytest.mark.kernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-12  # BERT's


def _inputs(rows: int, d: int, dtype: torch.dtype, extra: bool, seed: int = 0) -> list[torch.Tensor | None]:
    """``[x, residual, weight, bias, extra]`` on DEVICE (x at BERT's scale of a dense output, residual of a hidden
    state), each a leaf that requires grad."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(rows, d), (rows, d), (d,), (d,), (rows, d) if extra else None]
    scales = [0.5, 1.0, 0.2, 0.1, 0.3]
    out = []
    for shape, scale in zip(shapes, scales):
        if shape is None:
            out.append(None)
            continue
        t = torch.randn(shape, generator=g) * scale  # host: a seeded CPU draw, moved to DEVICE below
        if len(shape) == 1 and scale == 0.2:
            t += 1.0  # a LayerNorm weight near 1
        out.append(t.to(DEVICE, dtype).requires_grad_())
    return out


def _run(fn, inputs, p: float = 0.0, grad_seed: int = 1) -> list[torch.Tensor | None]:
    """``[y, dx, d_residual, dweight, dbias, d_extra]`` of ``fn`` on ``inputs``, the output gradient fixed."""
    x, residual, weight, bias, extra = inputs
    y = fn(x, residual, weight, bias, EPS, p, True, extra)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(grad_seed)).to(y.device, y.dtype)
    leaves = [t for t in (x, residual, weight, bias, extra) if t is not None]
    grads = list(torch.autograd.grad(y, leaves, dy))
    return [y, *grads] + ([None] if extra is None else [])


def _float64(inputs):
    return [None if t is None else t.detach().double().requires_grad_() for t in inputs]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d,extra", [(37, 384, False), (21, 768, True), (45, 100, True)])
def test_forward_and_gradients_match_float64(triton_mode, dtype, rows, d, extra):
    inputs = _inputs(rows, d, dtype, extra, seed=d)
    got = _run(dropout_add_layer_norm, inputs)
    ref = _run(dropout_add_layer_norm_reference, inputs)
    ref64 = _run(dropout_add_layer_norm_reference, _float64(inputs))
    names = ["y", "dx", "d_residual", "dweight", "dbias", "d_extra"]
    for name, a, r, r64 in zip(names, got, ref, ref64):
        if r64 is None:
            continue
        assert a.dtype == r.dtype, (name, a.dtype, r.dtype)
        assert_close_to_reference(f"{name} {dtype} d={d}", a, r, r64)
        if dtype == torch.float32:
            assert_fp32_close(name, a, r)


def test_mixed_dtypes_follow_type_promotion(triton_mode):
    """Under autocast a bf16 dense output meets an fp32 residual: fp32 output, each gradient in its input's
    dtype."""
    x, residual, weight, bias, _ = _inputs(19, 100, torch.float32, False, seed=3)
    x = x.detach().bfloat16().requires_grad_()
    inputs = [x, residual, weight, bias, None]
    got = _run(dropout_add_layer_norm, inputs)
    ref = _run(dropout_add_layer_norm_reference, inputs)
    assert [t.dtype for t in got[:5]] == [t.dtype for t in ref[:5]]
    for name, a, r in zip(["y", "dx", "d_residual", "dweight", "dbias"], got, ref):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5 if a.dtype == torch.float32 else 1e-2, msg=name)


def _sublayer_inputs(rows: int, d: int) -> list[torch.Tensor | None]:
    """x in [1, 2] and a zero residual, weight 1, bias 0: a dropped element is its row's smallest output."""
    g = torch.Generator().manual_seed(7)
    x = (1.0 + torch.rand(rows, d, generator=g)).to(DEVICE).requires_grad_()
    residual = torch.zeros(rows, d, device=DEVICE, requires_grad=True)
    weight = torch.ones(d, device=DEVICE, requires_grad=True)
    bias = torch.zeros(d, device=DEVICE, requires_grad=True)
    return [x, residual, weight, bias, None]


def test_backward_uses_the_forward_mask(triton_mode):
    p, rows, d = 0.3, 24, 100
    inputs = _sublayer_inputs(rows, d)
    torch.manual_seed(5)
    y, dx, d_residual, dweight, dbias, _ = _run(dropout_add_layer_norm, inputs, p=p)
    keep = y > y.min(dim=1, keepdim=True).values + 1e-3  # the dropped elements share their row's minimum
    assert 0.5 < keep.float().mean().item() < 0.9
    # float64 with that mask: the output and every gradient agree only if the backward recomputed the same mask
    x64, r64, w64, b64, _ = _float64(inputs)
    s = torch.where(keep, x64 / (1 - p), 0.0) + r64
    y64 = torch.nn.functional.layer_norm(s, (d,), w64, b64, EPS)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE).double()
    grads64 = torch.autograd.grad(y64, (x64, r64, w64, b64), dy)
    for name, a, r in zip(["y", "dx", "d_residual", "dweight", "dbias"], (y, dx, d_residual, dweight, dbias),
                          (y64, *grads64)):  # fmt: skip
        torch.testing.assert_close(a.double(), r, rtol=1e-5, atol=1e-5, msg=name)
    assert torch.all(dx[~keep] == 0)


def test_kept_fraction_and_determinism_for_a_seed(triton_mode):
    p = 0.1
    x, residual, weight, bias, _ = _sublayer_inputs(64, 384)

    def run(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return dropout_add_layer_norm(x, residual, weight, bias, EPS, p, True)

    y = run(11)
    kept = (y > y.min(dim=1, keepdim=True).values + 1e-3).float().mean().item()
    assert abs(kept - (1 - p)) < 0.01  # 24576 elements: 5 standard deviations
    assert torch.equal(run(11), y)
    assert not torch.equal(run(12), y)
    # eval mode and p = 0: no dropout
    no_dropout = dropout_add_layer_norm(x, residual, weight, bias, EPS, 0.0, True)
    assert torch.equal(dropout_add_layer_norm(x, residual, weight, bias, EPS, p, False), no_dropout)


def test_cpu_reference_path_is_dropout_add_then_layer_norm(monkeypatch):
    monkeypatch.setenv("FASTPALS_KERNELS", "reference")
    x, residual, weight, bias, _ = _inputs(9, 100, torch.float32, False)
    torch.manual_seed(3)
    got = dropout_add_layer_norm(x, residual, weight, bias, EPS, 0.1, True)
    torch.manual_seed(3)
    expected = torch.nn.functional.layer_norm(dropout_add(x, residual, 0.1, True), (100,), weight, bias, EPS)
    assert torch.equal(got, expected)


def test_fake_tensors_give_the_shapes(triton_mode):
    with FakeTensorMode() as mode:
        x = torch.empty(2, 5, 100, dtype=torch.bfloat16, device=DEVICE)
        residual, extra = torch.empty_like(x), torch.empty_like(x)
        w, b = torch.empty(100, device=DEVICE), torch.empty(100, device=DEVICE)
        seed = torch.zeros(1, dtype=torch.int64)  # host: the op's seed is a host tensor
        y, mean, rstd = torch.ops.fastpals.dropout_add_layer_norm(
            x, residual, extra, w, b, 1e-12, 0.1, seed, torch.float32
        )
        grads = torch.ops.fastpals.dropout_add_layer_norm_backward(
            y, x, residual, extra, w, b, mean, rstd, 0.1, seed
        )
        public = dropout_add_layer_norm(x, residual, w, b, 1e-12, 0.1, True, extra)
    assert mode is not None
    assert (y.shape, y.dtype, mean.shape, rstd.shape) == (x.shape, torch.float32, (10,), (10,))
    assert [(g.shape, g.dtype) for g in grads] == [(t.shape, t.dtype) for t in (residual, x, w, b)]
    assert public.shape == x.shape and public.dtype == torch.bfloat16


def test_opcheck(triton_mode):
    x, residual, weight, bias, extra = _inputs(5, 20, torch.float32, True)
    seed = torch.tensor([123], dtype=torch.int64)  # host: the op's seed is a host tensor
    torch.library.opcheck(
        torch.ops.fastpals.dropout_add_layer_norm.default,
        (x, residual, extra, weight, bias, 1e-5, 0.2, seed, torch.float32),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


def test_vmap_runs_the_op_per_sample(triton_mode):
    x, residual, weight, bias, _ = _inputs(6, 100, torch.float32, False)
    xs, residuals = torch.stack([x, 2 * x]).detach(), torch.stack([residual, residual]).detach()
    w, b = weight.detach(), bias.detach()
    got = torch.func.vmap(lambda a, r: dropout_add_layer_norm(a, r, w, b, EPS, 0.0))(xs, residuals)
    expected = torch.stack([dropout_add_layer_norm(a, r, w, b, EPS, 0.0) for a, r in zip(xs, residuals)])
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"x": "x"}, "x must be a torch.Tensor"),
        ({"x": torch.zeros(3, 4, dtype=torch.float64)}, "x must be float32"),  # host: bad input
        ({"residual": torch.zeros(3, 5)}, r"residual must have x's shape \[3, 4\]"),  # host: bad input
        ({"extra": torch.zeros(4, 4)}, "extra must have x's shape"),  # host: bad input
        ({"weight": torch.zeros(5)}, r"weight must have shape \[4\]"),  # host: bad input
        ({"bias": torch.zeros(4, 1)}, r"bias must have shape \[4\]"),  # host: bad input
        ({"eps": 0.0}, "eps must be a positive float"),
        ({"p": 1.0}, r"p must be a float in \[0, 1\)"),
        ({"x": torch.zeros(3, 0), "residual": torch.zeros(3, 0)}, "d >= 1"),  # host: bad input
    ],
)
def test_bad_inputs_name_the_argument(triton_mode, change, match):
    args = {"x": torch.zeros(3, 4, device=DEVICE), "residual": torch.zeros(3, 4, device=DEVICE),
            "weight": torch.ones(4, device=DEVICE), "bias": torch.zeros(4, device=DEVICE), "eps": 1e-5, "p": 0.1,
            "training": True, "extra": None}  # fmt: skip
    args.update(change)
    args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises((TypeError, ValueError), match=match) as info:
        dropout_add_layer_norm(**args)
    assert "\n" not in str(info.value)


def test_model_sublayers_through_the_op(triton_mode, monkeypatch):
    """BertModel with the fused sublayer LayerNorms (forced here: the model picks the op on CUDA only) equals the
    unfused model, output and gradients."""
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
                     max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    torch.manual_seed(0)
    model = BertModel(cfg).to(DEVICE).train()
    ids = torch.randint(1, 64, (3, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask = torch.ones(3, 9, dtype=torch.long, device=DEVICE)
    mask[1, 5:] = 0

    def step(m):
        out = m(ids, mask).last_hidden_state
        (out * mask[..., None]).pow(2).mean().backward()
        return out, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}

    fused_model = copy.deepcopy(model)
    ref_out, ref_grads = step(model)
    calls = []
    fused = bert.dropout_add_layer_norm
    monkeypatch.setattr(bert, "fused_layer_norm", lambda y, norm: True)
    monkeypatch.setattr(bert, "dropout_add_layer_norm", lambda *a: calls.append(1) or fused(*a))
    out, grads = step(fused_model)
    assert len(calls) == 2 * cfg.num_hidden_layers
    assert_fp32_close("last_hidden_state", out, ref_out)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert_fp32_close(name, grads[name], ref_grads[name])
