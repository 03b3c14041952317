"""The PAL op (fastpals_kernels.pal): the fused PAL (pal / pal_varlen) against fastpals.functional.pal_reference,
its flash-style attention (pal_attention / pal_attention_varlen) against the attention references, the package
API and the FASTPALS_KERNELS switch.

Every fused-PAL case checks the output and the gradients of h, the six weights and biases, and the residual.
fp32 within 1e-5 of the fp32 reference; every dtype: the kernel's max error against a float64 transcription at
most 2x the same-dtype reference's (tests/tolerances.py). Inputs are drawn on the CPU and moved to
tests/device.py's DEVICE; off CUDA the kernels run in Triton's interpreter, so shapes are small.
"""

import importlib
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from device import DEVICE, ON_CUDA, TRITON_INTERPRETED, requires_cuda
from tolerances import assert_close_to_reference, assert_fp32_close

import fastpals_kernels as kernels
from fastpals.functional import (
    attention_reference,
    attention_varlen_reference,
    grouped_linear_reference,
    pal_reference,
    pal_varlen_reference,
)
from fastpals_kernels import backends as kernel_backends
from fastpals_kernels.common import load_triton
from fastpals_kernels.pal import MAX_HEAD_DIM, pal_attention, pal_attention_dropout_mask, pal_attention_varlen

pytestmark = pytest.mark.kernels

NAMES = [
    "out",
    "dh",
    "d_enc_weight",
    "d_enc_bias",
    "d_qkv_weight",
    "d_qkv_bias",
    "d_dec_weight",
    "d_dec_bias",
]
TASK_MIXES = {
    "one_task": ([1, 1, 1, 1], 3),
    "uniform": ([0, 1, 2, 0], 3),
    "skewed": ([2, 2, 0, 2], 3),
    "empty_task": ([3, 0, 3, 3], 4),  # tasks 1 and 2 have no examples
}


def _weights(num_tasks, d, d_s, dtype, g):
    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype).requires_grad_()

    return [
        rnd(num_tasks, d_s, d, scale=d**-0.5),
        rnd(num_tasks, d_s, scale=0.1),
        rnd(num_tasks, 3 * d_s, d_s, scale=d_s**-0.5),
        rnd(num_tasks, 3 * d_s, scale=0.1),
        rnd(num_tasks, d, d_s, scale=d_s**-0.5),
        rnd(num_tasks, d, scale=0.1),
    ]


def _grads(out, leaves, dy):
    wrt = [t for t in leaves if t is not None]
    return [out.detach(), *torch.autograd.grad(out, wrt, dy)]


def _padded_case(batch, length, d, d_s, num_tasks, dtype, residual, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, length, d, generator=g).to(DEVICE, dtype).requires_grad_()
    res = torch.randn(batch, length, d, generator=g).to(DEVICE, dtype).requires_grad_() if residual else None
    dy = torch.randn(batch, length, d, generator=g).to(DEVICE, dtype)
    mask = torch.ones(batch, length, dtype=torch.long, device=DEVICE)
    for b in range(batch):  # lengths L, L-2, 1, L-1, ...: padding everywhere but the first example
        keep = [length, length - 2, 1, length - 1][b % 4]
        mask[b, keep:] = 0
    return h, mask, _weights(num_tasks, d, d_s, dtype, g), res, dy


def _check_fp32(got, want, names, exact=None):
    """fp32 outputs and gradients within 1e-5 of the reference's; with ``exact`` (their float64 values), also at
    most 2x the reference's error."""
    for i, (name, a, e) in enumerate(zip(names, got, want)):
        assert_fp32_close(name, a, e)
        if exact is not None:
            assert_close_to_reference(name, a, e, exact[i])


def _float64(leaves):
    return [None if t is None else t.detach().double().requires_grad_() for t in leaves]


def _pal_transcription(h, mask, task_ids, weights, heads, gelu=True, keep=None, dropout_p=0.0):
    """The PAL in h's dtype, softmax included (pal_reference computes it in fp32), with an explicit attention-
    dropout keep mask [B, H, L, L] or none; mask [B, L] or None."""
    we, be, wq, bq, wd, bd = weights
    batch, length, _ = h.shape
    d_s = we.shape[1]
    s = grouped_linear_reference(h, task_ids, we, be)
    qkv = grouped_linear_reference(s, task_ids, wq, bq).view(batch, length, 3, heads, d_s // heads)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d_s // heads)
    if mask is not None:
        scores = scores.masked_fill(~mask.bool()[:, None, None, :], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, -1)
    if keep is not None:
        probs = probs * keep / (1.0 - dropout_p)
    ctx = (probs @ v).transpose(1, 2).reshape(batch, length, d_s)
    y = grouped_linear_reference(ctx, task_ids, wd, bd)
    return F.gelu(y) if gelu else y


def _pal_varlen_transcription(h, cu_seqlens, task_ids, weights, heads, gelu=True):
    """_pal_transcription over each packed sequence of h [N, d] -> [N, d]."""
    bounds = cu_seqlens.tolist()
    outs = [
        _pal_transcription(h[a:b][None], None, task_ids[i : i + 1], weights, heads, gelu)[0]
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))
    ]
    return torch.cat(outs)


# (d_s, heads): head dims 17, 34, 46, and the BERT-base PAL's 6 x 34 (d_s = 204, the wide-row-tile path)
@pytest.mark.parametrize(
    "d_s, heads, mix, gelu, residual",
    [
        (34, 2, "uniform", True, True),
        (34, 1, "skewed", False, True),
        (46, 1, "empty_task", True, False),
        (92, 2, "one_task", True, True),
        (204, 6, "uniform", True, False),
    ],
)
def test_pal_padded_fp32_matches_reference(d_s, heads, mix, gelu, residual):
    ids, num_tasks = TASK_MIXES[mix]
    task_ids = torch.tensor(ids, device=DEVICE)
    h, mask, weights, res, dy = _padded_case(len(ids), 7, 40, d_s, num_tasks, torch.float32, residual)
    leaves = [h, *weights, res]
    out = kernels.pal(h, mask, task_ids, *weights, heads, gelu, 0.0, residual=res)
    ref = pal_reference(h, mask, task_ids, *weights, heads, gelu, 0.0)
    ref = ref if res is None else res + ref
    h64, *w64, res64 = leaves64 = _float64(leaves)
    ref64 = _pal_transcription(h64, mask, task_ids, w64, heads, gelu)
    ref64 = ref64 if res is None else res64 + ref64
    got, want = _grads(out, leaves, dy), _grads(ref, leaves, dy)
    _check_fp32(got, want, NAMES + ["d_residual"], exact=_grads(ref64, leaves64, dy.double()))
    for t in set(range(num_tasks)) - set(ids):
        assert all(torch.count_nonzero(grad[t]) == 0 for grad in got[2:8]), f"task {t} has no examples"


@pytest.mark.parametrize("d_s, heads, gelu, residual", [(34, 2, True, True), (46, 1, False, False)])
def test_pal_varlen_fp32_matches_reference(d_s, heads, gelu, residual):
    g = torch.Generator().manual_seed(3)
    lengths = [5, 0, 9, 1, 4]
    task_ids = torch.tensor([2, 1, 0, 2, 2], device=DEVICE)  # task 1 only on the empty sequence
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    n, d, max_seqlen = sum(lengths), 24, 9
    h = torch.randn(n, d, generator=g).to(DEVICE).requires_grad_()
    res = torch.randn(n, d, generator=g).to(DEVICE).requires_grad_() if residual else None
    dy = torch.randn(n, d, generator=g).to(DEVICE)
    weights = _weights(3, d, d_s, torch.float32, g)
    leaves = [h, *weights, res]
    out = kernels.pal_varlen(h, cu, max_seqlen, task_ids, *weights, heads, gelu, 0.0, residual=res)
    ref = pal_varlen_reference(h, cu, max_seqlen, task_ids, *weights, heads, gelu, 0.0)
    ref = ref if res is None else res + ref
    h64, *w64, res64 = leaves64 = _float64(leaves)
    ref64 = _pal_varlen_transcription(h64, cu, task_ids, w64, heads, gelu)
    ref64 = ref64 if res is None else res64 + ref64
    got, want = _grads(out, leaves, dy), _grads(ref, leaves, dy)
    _check_fp32(got, want, NAMES + ["d_residual"], exact=_grads(ref64, leaves64, dy.double()))
    assert all(torch.count_nonzero(grad[1]) == 0 for grad in got[2:8])


def test_pal_varlen_int64_boundaries_and_one_host_read_per_tensor(monkeypatch):
    """int64 cu_seqlens follow the int32 rule (same result); the boundaries are read on the host once per tensor,
    so the PALs of every layer of one forward (same cu_seqlens object) sync once, not once per layer."""
    g = torch.Generator().manual_seed(5)
    cu32 = torch.tensor([0, 3, 9, 11], dtype=torch.int32, device=DEVICE)
    cu64 = cu32.long()
    h = torch.randn(11, 16, generator=g).to(DEVICE)
    weights = [w.detach() for w in _weights(2, 16, 12, torch.float32, g)]
    task_ids = torch.tensor([1, 0, 1], device=DEVICE)
    reads = []
    original = torch.Tensor.tolist

    def counting_tolist(t):
        if t is cu64:
            reads.append(1)
        return original(t)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    outs = [kernels.pal_varlen(h, cu64, 6, task_ids, *weights, 2, True, 0.0) for _ in range(3)]  # 3 "layers"
    assert len(reads) == 1, reads
    want = kernels.pal_varlen(h, cu32, 6, task_ids, *weights, 2, True, 0.0)
    for out in outs:
        torch.testing.assert_close(out, want, atol=0, rtol=0)
    with pytest.raises(ValueError, match="max_seqlen = 5 is shorter"):
        kernels.pal_varlen(h, cu64, 5, task_ids, *weights, 2, True, 0.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pal_half_precision_error_at_most_twice_reference(dtype):
    task_ids = torch.tensor([2, 0, 2, 2], device=DEVICE)
    h, mask, weights, res, dy = _padded_case(4, 8, 48, 34, 3, dtype, residual=True, seed=5)
    leaves = [h, *weights, res]
    out = kernels.pal(h, mask, task_ids, *weights, 2, True, 0.0, residual=res)
    got = _grads(out, leaves, dy)
    want = _grads(res + pal_reference(h, mask, task_ids, *weights, 2, True, 0.0), leaves, dy)
    h64, *w64, res64 = leaves64 = _float64(leaves)
    exact = _grads(res64 + _pal_transcription(h64, mask, task_ids, w64, 2), leaves64, dy.double())
    for name, a, r, e in zip(NAMES + ["d_residual"], got, want, exact):
        assert a.dtype == dtype, name
        assert_close_to_reference(name, a, r, e, rtol=1e-6)


def test_pal_attention_dropout_follows_seed():
    task_ids = torch.tensor([1, 0, 1, 1], device=DEVICE)
    h, mask, weights, _, dy = _padded_case(4, 8, 24, 34, 2, torch.float32, residual=False, seed=7)
    p, seed = 0.25, 1234
    out = kernels.pal(h, mask, task_ids, *weights, 2, True, p, generator_seed=seed)
    keep = pal_attention_dropout_mask(4, 2, 8, p, seed, DEVICE)
    assert 0 < keep.float().mean() < 1
    ref = _pal_transcription(h, mask, task_ids, weights, 2, keep=keep, dropout_p=p)
    h64, *w64 = leaves64 = _float64([h, *weights])
    ref64 = _pal_transcription(h64, mask, task_ids, w64, 2, keep=keep, dropout_p=p)
    want, exact = _grads(ref, [h, *weights], dy), _grads(ref64, leaves64, dy.double())
    _check_fp32(_grads(out, [h, *weights], dy), want, NAMES, exact=exact)


def test_pal_varlen_dropout_equals_padded_dropout():
    """Packed and padded batches holding the same tokens drop the same probabilities for one seed."""
    g = torch.Generator().manual_seed(11)
    lengths = torch.tensor([3, 8, 5], device=DEVICE)
    task_ids = torch.tensor([1, 0, 1], device=DEVICE)
    cu = torch.tensor([0, 3, 11, 16], dtype=torch.int32, device=DEVICE)
    mask = torch.arange(8, device=DEVICE)[None, :] < lengths[:, None]
    h_pad = torch.randn(3, 8, 24, generator=g).to(DEVICE) * mask[..., None]
    h_pad.requires_grad_()
    weights = _weights(2, 24, 34, torch.float32, g)
    padded = kernels.pal(h_pad, mask, task_ids, *weights, 2, True, 0.3, generator_seed=99)[mask]
    h_packed = h_pad.detach()[mask].requires_grad_()
    packed = kernels.pal_varlen(h_packed, cu, 8, task_ids, *weights, 2, True, 0.3, generator_seed=99)
    dy = torch.randn(packed.shape, generator=g).to(DEVICE)
    got = _grads(packed, [h_packed, *weights], dy)
    want = _grads(padded, [h_pad, *weights], dy)
    want[1] = want[1][mask]
    _check_fp32(got, want, NAMES)


class TestPalValidation:
    def setup_method(self):
        g = torch.Generator().manual_seed(0)
        self.h = torch.randn(2, 5, 16, generator=g).to(DEVICE)
        self.mask = torch.ones(2, 5, device=DEVICE)
        self.ids = torch.tensor([0, 1], device=DEVICE)
        self.weights = [w.detach() for w in _weights(2, 16, 34, torch.float32, g)]

    def test_heads_must_divide_width(self):
        with pytest.raises(ValueError, match="num_heads"):
            kernels.pal(self.h, self.mask, self.ids, *self.weights, 4)

    def test_weight_shapes(self):
        w = list(self.weights)
        w[2] = torch.randn(2, 3 * 34, 33, device=DEVICE)
        with pytest.raises(ValueError, match="qkv_weight must have shape"):
            kernels.pal(self.h, self.mask, self.ids, *w, 2)
        w = list(self.weights)
        w[5] = torch.randn(2, 17, device=DEVICE)
        with pytest.raises(ValueError, match="dec_bias must have shape"):
            kernels.pal(self.h, self.mask, self.ids, *w, 2)

    def test_mask_residual_dtype_and_task_ids(self):
        with pytest.raises(ValueError, match="attention_mask"):
            kernels.pal(self.h, torch.ones(2, 4, device=DEVICE), self.ids, *self.weights, 2)
        with pytest.raises(ValueError, match="residual must have shape"):
            kernels.pal(
                self.h, self.mask, self.ids, *self.weights, 2, residual=torch.randn(2, 5, 15, device=DEVICE)
            )
        with pytest.raises(TypeError, match="enc_weight has dtype torch.float16"):
            kernels.pal(self.h, self.mask, self.ids, self.weights[0].half(), *self.weights[1:], 2)
        with pytest.raises(ValueError, match="outside \\[0, 2\\)"):
            kernels.pal(self.h, self.mask, torch.tensor([0, 2], device=DEVICE), *self.weights, 2)
        with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
            kernels.pal_varlen(
                self.h[0],
                torch.tensor([0, 2, 4], dtype=torch.int32, device=DEVICE),
                2,
                self.ids,
                *self.weights,
                2,
            )


#: the dispatch rule for a tensor on the host, whatever DEVICE is
HOST_TENSOR = torch.zeros(1, device="cpu")  # host: the rule under test is the CPU tensor's


class TestDispatch:
    def test_reference_mode(self, monkeypatch):
        monkeypatch.setenv("FASTPALS_KERNELS", "reference")
        assert kernels.use_triton(HOST_TENSOR) is False

    def test_auto_mode_uses_reference_on_cpu(self, monkeypatch):
        monkeypatch.delenv("FASTPALS_KERNELS", raising=False)
        assert kernels.kernel_mode() == "auto"
        assert kernels.use_triton(HOST_TENSOR) is False
        monkeypatch.setenv("FASTPALS_KERNELS", "AUTO")
        assert kernels.use_triton(HOST_TENSOR) is False

    def test_triton_mode_on_cpu_needs_the_interpreter(self, monkeypatch):
        load_triton(
            vars(importlib.import_module("fastpals_kernels.grouped_linear"))
        )  # kernels defined before the change

        monkeypatch.setenv("FASTPALS_KERNELS", "triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        if TRITON_INTERPRETED:  # the kernels are interpreted functions: a CPU tensor may run them
            assert kernels.use_triton(HOST_TENSOR) is True
        else:  # compiled for the GPU: setting the variable now is too late, and use_triton says so
            with pytest.raises(RuntimeError, match="loaded before TRITON_INTERPRET=1"):
                kernels.use_triton(HOST_TENSOR)
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            kernels.use_triton(HOST_TENSOR)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        with pytest.raises(RuntimeError, match="meta"):
            kernels.use_triton(torch.zeros(1, device="meta"))

    def test_triton_mode_on_cpu_with_kernels_loaded_for_gpu_is_an_error(self, monkeypatch):
        import types

        fake = types.ModuleType("fastpals_kernels.grouped_linear")
        fake._grouped_mm_kernel = (
            object()
        )  # a GPU-compiled JITFunction stands here when TRITON_INTERPRET was unset
        monkeypatch.setitem(sys.modules, "fastpals_kernels.grouped_linear", fake)
        monkeypatch.setenv("FASTPALS_KERNELS", "triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        with pytest.raises(RuntimeError, match="loaded before TRITON_INTERPRET=1"):
            kernels.use_triton(HOST_TENSOR)

    def test_triton_mode_without_triton_is_an_error(self, monkeypatch):
        monkeypatch.setenv("FASTPALS_KERNELS", "triton")
        monkeypatch.setattr(
            kernel_backends, "_triton_import_error", lambda: "ImportError: no module named triton"
        )
        ok, reason = kernels.available()
        assert not ok and "not importable" in reason
        with pytest.raises(RuntimeError, match="cannot run"):
            kernels.use_triton(HOST_TENSOR)
        monkeypatch.setenv("FASTPALS_KERNELS", "auto")
        assert kernels.use_triton(HOST_TENSOR) is False

    def test_bad_mode(self, monkeypatch):
        monkeypatch.setenv("FASTPALS_KERNELS", "cuda")
        with pytest.raises(ValueError, match="FASTPALS_KERNELS='cuda'"):
            kernels.use_triton(HOST_TENSOR)

    @requires_cuda
    def test_auto_mode_uses_triton_on_cuda(self, monkeypatch):
        monkeypatch.delenv("FASTPALS_KERNELS", raising=False)
        assert kernels.use_triton(torch.zeros(1, device=DEVICE)) is True


def test_package_import_is_cheap_and_safe_without_triton():
    """``import fastpals_kernels`` loads no Triton; without Triton, available() says why and the ops raise a clear
    ImportError; an op whose module has its name stays the function after the module is imported."""
    code = """
import sys
import fastpals_kernels as k
assert "triton" not in sys.modules, "import fastpals_kernels imported triton"
sys.modules["triton"] = None  # as if triton were not installed
ok, reason = k.available()
assert not ok and "not importable" in reason, reason
import inspect
for op in (k.pal, k.pal_varlen, k.pal_attention, k.grouped_linear):
    required = [p for p in inspect.signature(op).parameters.values() if p.default is p.empty]
    try:
        op(*[None] * len(required))
    except ImportError as exc:
        assert "needs Triton" in str(exc), exc
    else:
        raise AssertionError(f"{op.__name__} without triton did not raise")
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_exported_ops_are_functions_not_modules():
    for module in ("grouped_linear", "pal", "gram", "combine", "attention_varlen"):
        importlib.import_module(f"fastpals_kernels.{module}")  # an op module named as its op

    for name in (
        "pal",
        "pal_varlen",
        "grouped_linear",
        "grouped_linear_varlen",
        "pal_attention",
        "gram",
        "combine",
    ):
        assert callable(getattr(kernels, name)), name
    assert kernels.pal.__module__ == "fastpals_kernels.pal"
    assert kernels.pal_attention.__module__ == "fastpals_kernels.pal"
    assert kernels.gram.__module__ == "fastpals_kernels.gram"


@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.bfloat16])
def test_pal_under_autocast_follows_the_reference(residual_dtype):
    """fp32 parameters under bf16 autocast (the model's mixed-precision path): the kernel casts like F.linear,
    returns the reference's dtype, and the fp32 parameters get fp32 gradients close to the reference's."""
    task_ids = torch.tensor([1, 0, 1, 1], device=DEVICE)
    h, mask, weights, res, dy = _padded_case(4, 8, 40, 34, 2, torch.float32, residual=True, seed=9)
    res = res.detach().to(residual_dtype).requires_grad_()
    leaves = [h, *weights, res]
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = kernels.pal(h, mask, task_ids, *weights, 2, True, 0.0, residual=res)
        ref = res + pal_reference(h, mask, task_ids, *weights, 2, True, 0.0)
    assert out.dtype == ref.dtype
    got, want = _grads(out, leaves, dy.to(out.dtype)), _grads(ref, leaves, dy.to(ref.dtype))
    for name, a, e in zip(NAMES + ["d_residual"], got, want):
        assert a.dtype == e.dtype, name
        scale = e.abs().max().item()
        assert (a - e).abs().max().item() <= 3e-2 * scale + 1e-3, name


# ==============================================================================================================
# The PAL attention (pal_attention, pal_attention_varlen)
# ==============================================================================================================
# ------------------------------------------------------------------------------------------------ helpers


def packed_qkv(batch, length, heads, head_dim, dtype=torch.float32, seed=0):
    """q, k, v as strided views of one [B, L, 3*H*Dh] projection output, as the PAL produces them."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, length, 3 * heads * head_dim, generator=gen).to(DEVICE, dtype).requires_grad_()
    q, k, v = qkv.view(batch, length, 3, heads, head_dim).unbind(2)
    return qkv, q, k, v


def randn(*shape, seed, dtype=torch.float32):
    """Seeded normal tensor on DEVICE (tests do not depend on the global RNG or on test order)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def ragged_mask(lengths, length):
    return torch.arange(length, device=DEVICE)[None, :] < torch.tensor(lengths, device=DEVICE)[:, None]


def out_and_grad(out, leaf, out_grad):
    (grad,) = torch.autograd.grad(out, leaf, out_grad)
    return out.detach(), grad


def split_qkv_grad(grad):
    """The gradient of a packed [..., 3*H*Dh] projection -> {"dq": ..., "dk": ..., "dv": ...}."""
    return dict(zip(("dq", "dk", "dv"), grad.unflatten(-1, (3, -1)).unbind(-2)))


def assert_fp32_matches(name, got, ref, ref64):
    """fp32 rule: within 1e-5 of the fp32 reference and at most 2x its error against float64."""
    assert_fp32_close(name, got, ref)
    assert_close_to_reference(name, got, ref, ref64)


def float64_qkv(qkv, *view):
    """A float64 leaf copy of a packed projection output and its q, k, v views (split on dim -3)."""
    qkv64 = qkv.detach().double().requires_grad_()
    return (qkv64, *qkv64.view(*view).unbind(-3))


def attention_with_keep_mask(q, k, v, key_padding_mask, keep=None, dropout_p=0.0, softmax_scale=None):
    """attention_reference's op order with F.dropout replaced by a given keep mask [B, H, L, L] (or none); the
    softmax in fp32, or in float64 for float64 inputs (attention_reference computes it in fp32 always)."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    softmax_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    scores = torch.matmul(qh, kh.transpose(-1, -2)).to(softmax_dtype) * scale
    if key_padding_mask is not None:
        bias = torch.zeros(scores.shape[0], 1, 1, scores.shape[-1], dtype=softmax_dtype, device=scores.device)
        bias = bias.masked_fill(~key_padding_mask.bool()[:, None, None, :], torch.finfo(torch.float32).min)
        scores = scores + bias
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    if keep is not None:
        probs = probs * (keep.to(q.dtype) / (1.0 - dropout_p))
    return torch.matmul(probs, vh).transpose(1, 2)


def varlen_attention_float64(q, k, v, cu_seqlens):
    """attention_with_keep_mask over each packed sequence of float64 q, k, v [N, H, Dh] -> [N, H, Dh]."""
    bounds = cu_seqlens.tolist()
    rows = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat([attention_with_keep_mask(q[r][None], k[r][None], v[r][None], None)[0] for r in rows])


def varlen_inputs(lengths, heads, head_dim, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    qkv = torch.randn(total, 3 * heads * head_dim, generator=gen).to(DEVICE, dtype).requires_grad_()
    q, k, v = qkv.view(total, 3, heads, head_dim).unbind(1)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return qkv, q, k, v, cu


# ------------------------------------------------------------------------------------------------ fp32 exactness


@pytest.mark.parametrize(
    "heads, head_dim, lengths, scale",
    [
        (
            4,
            17,
            [21, 9, 1],
            None,
        ),  # 12 heads of 17 in the "top" PAL variant; ragged padding, a 1-token sequence
        (
            2,
            34,
            [16, 0, 11],
            None,
        ),  # 6 heads of 34; a sequence with no token at all (uniform average, no NaN)
        (3, 46, None, 0.3),  # 6 heads of 46 ("half" PALs); no mask; a custom softmax scale
        (1, 64, [24, 5], None),
    ],
)
def test_padded_fp32_matches_reference(heads, head_dim, lengths, scale):
    batch = 3 if lengths is None else len(lengths)
    length = 21 if lengths is None else max(lengths)
    qkv, q, k, v = packed_qkv(batch, length, heads, head_dim, seed=head_dim)
    mask = None if lengths is None else ragged_mask(lengths, length)
    out_grad = randn(batch, length, heads, head_dim, seed=100)
    out, grad = out_and_grad(pal_attention(q, k, v, mask, softmax_scale=scale), qkv, out_grad)
    ref, ref_grad = out_and_grad(attention_reference(q, k, v, mask, softmax_scale=scale), qkv, out_grad)
    qkv64, q64, k64, v64 = float64_qkv(qkv, batch, length, 3, heads, head_dim)
    ref64, ref64_grad = out_and_grad(
        attention_with_keep_mask(q64, k64, v64, mask, softmax_scale=scale), qkv64, out_grad.double()
    )
    assert (
        out.shape == (batch, length, heads, head_dim) and out.is_contiguous() and out.dtype == torch.float32
    )
    assert torch.isfinite(out).all() and torch.isfinite(grad).all()
    assert_fp32_matches("out", out, ref, ref64)
    for name in ("dq", "dk", "dv"):
        g, r, r64 = (split_qkv_grad(x)[name] for x in (grad, ref_grad, ref64_grad))
        assert_fp32_matches(name, g, r, r64)


def test_varlen_fp32_matches_reference():
    lengths, heads, head_dim = (
        [7, 1, 0, 19, 3],
        3,
        34,
    )  # a 1-token and an empty sequence; max_seqlen > longest
    qkv, q, k, v, cu = varlen_inputs(lengths, heads, head_dim, seed=1)
    out_grad = randn(sum(lengths), heads, head_dim, seed=101)
    out, grad = out_and_grad(pal_attention_varlen(q, k, v, cu, 20), qkv, out_grad)
    ref, ref_grad = out_and_grad(attention_varlen_reference(q, k, v, cu, 20), qkv, out_grad)
    qkv64, q64, k64, v64 = float64_qkv(qkv, sum(lengths), 3, heads, head_dim)
    ref64, ref64_grad = out_and_grad(varlen_attention_float64(q64, k64, v64, cu), qkv64, out_grad.double())
    assert out.shape == (sum(lengths), heads, head_dim) and out.is_contiguous()
    assert_fp32_matches("out", out, ref, ref64)
    assert_fp32_matches("dq, dk, dv", grad, ref_grad, ref64_grad)


def test_head_dim_extremes_fp32():
    """Head dims 1 (padded to 16), 100 (to 128, not a power of two) and 128 (the limit)."""
    for seed, head_dim in enumerate((1, 100, 128)):
        qkv, q, k, v = packed_qkv(2, 7, 2, head_dim, seed=seed)
        mask = ragged_mask([7, 3], 7)
        out_grad = randn(2, 7, 2, head_dim, seed=200 + seed)
        out, grad = out_and_grad(pal_attention(q, k, v, mask), qkv, out_grad)
        ref, ref_grad = out_and_grad(attention_reference(q, k, v, mask), qkv, out_grad)
        qkv64, q64, k64, v64 = float64_qkv(qkv, 2, 7, 3, 2, head_dim)
        ref64, ref64_grad = out_and_grad(
            attention_with_keep_mask(q64, k64, v64, mask), qkv64, out_grad.double()
        )
        assert_fp32_matches(f"Dh={head_dim} out", out, ref, ref64)
        assert_fp32_matches(f"Dh={head_dim} dq, dk, dv", grad, ref_grad, ref64_grad)


def test_layouts_and_partial_gradients():
    """Last dim not contiguous (copied), grad-output with zero strides, only q requiring a gradient, empty batch."""
    q = randn(2, 9, 17, 2, seed=1).transpose(-1, -2).requires_grad_()  # [2, 9, 2, 17], stride(-1) != 1
    k = randn(2, 9, 2, 17, seed=2)
    v = randn(2, 9, 2, 17, seed=3)
    mask = ragged_mask([9, 4], 9).to(torch.int64)
    out = pal_attention(q, k, v, mask)
    ref = attention_reference(q, k, v, mask)
    q64 = q.detach().double().requires_grad_()
    ref64 = attention_with_keep_mask(q64, k.double(), v.double(), mask)
    assert_fp32_matches("out", out, ref, ref64)
    (dq,) = torch.autograd.grad(out.sum(), q)  # sum().backward() hands in an expanded, stride-0 gradient
    (ref_dq,) = torch.autograd.grad(ref.sum(), q)
    (ref64_dq,) = torch.autograd.grad(ref64.sum(), q64)
    assert_fp32_matches("dq", dq, ref_dq, ref64_dq)
    empty = torch.randn(0, 5, 2, 17, device=DEVICE, requires_grad=True)
    out = pal_attention(empty, empty, empty)
    assert out.shape == (0, 5, 2, 17)
    out.sum().backward()
    assert empty.grad.shape == empty.shape


# ------------------------------------------------------------------------------------------------ fp16 / bf16


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_within_2x_reference_error(dtype):
    """On CPU the interpreter runs fp16 natively and bf16 through fp32-widened tiles (its bf16 tl.dot is broken)."""
    heads, head_dim, lengths = 3, 46, [20, 13, 1]
    qkv, q, k, v = packed_qkv(len(lengths), 20, heads, head_dim, dtype=dtype, seed=7)
    mask = ragged_mask(lengths, 20)
    out_grad = randn(len(lengths), 20, heads, head_dim, seed=102, dtype=dtype)
    qkv64, q64, k64, v64 = float64_qkv(qkv, len(lengths), 20, 3, heads, head_dim)
    ref64, ref64_grad = out_and_grad(attention_with_keep_mask(q64, k64, v64, mask), qkv64, out_grad.double())
    ref, ref_grad = out_and_grad(attention_reference(q, k, v, mask), qkv, out_grad)
    out, grad = out_and_grad(pal_attention(q, k, v, mask), qkv, out_grad)
    assert out.dtype == dtype and grad.dtype == dtype
    assert_close_to_reference("out", out, ref, ref64, rtol=0.0, atol=1e-4)
    for name in ("dq", "dk", "dv"):
        g, r, r64 = (split_qkv_grad(x)[name] for x in (grad, ref_grad, ref64_grad))
        assert_close_to_reference(name, g, r, r64, rtol=0.0, atol=1e-4)

    lengths = [5, 1, 17]
    qkv, q, k, v, cu = varlen_inputs(lengths, 2, 17, dtype=dtype, seed=8)
    qkv64, q64, k64, v64 = float64_qkv(qkv, sum(lengths), 3, 2, 17)
    out_grad = randn(sum(lengths), 2, 17, seed=103, dtype=dtype)
    ref64, ref64_grad = out_and_grad(varlen_attention_float64(q64, k64, v64, cu), qkv64, out_grad.double())
    ref, ref_grad = out_and_grad(attention_varlen_reference(q, k, v, cu, 17), qkv, out_grad)
    out, grad = out_and_grad(pal_attention_varlen(q, k, v, cu, 17), qkv, out_grad)
    assert_close_to_reference("varlen out", out, ref, ref64, rtol=0.0, atol=1e-4)
    for name in ("dq", "dk", "dv"):
        g, r, r64 = (split_qkv_grad(x)[name] for x in (grad, ref_grad, ref64_grad))
        assert_close_to_reference("varlen " + name, g, r, r64, rtol=0.0, atol=1e-4)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads, head_dim", [(12, 17), (6, 34), (6, 46), (4, 64), (2, 128)])
def test_gpu_sizes_within_2x_reference_error(dtype, heads, head_dim):
    """GPU launch configurations (blocks of 64-128, several tiles per sequence) on BERT-sized batches."""
    lengths = [300, 128, 77, 1]
    qkv, q, k, v = packed_qkv(len(lengths), 300, heads, head_dim, dtype=dtype, seed=head_dim)
    mask = ragged_mask(lengths, 300)
    out_grad = randn(len(lengths), 300, heads, head_dim, seed=104, dtype=dtype)
    qkv64, q64, k64, v64 = float64_qkv(qkv, len(lengths), 300, 3, heads, head_dim)
    ref64, ref64_grad = out_and_grad(attention_with_keep_mask(q64, k64, v64, mask), qkv64, out_grad.double())
    ref, ref_grad = out_and_grad(attention_reference(q, k, v, mask), qkv, out_grad)
    out, grad = out_and_grad(pal_attention(q, k, v, mask), qkv, out_grad)
    floor = {"rtol": 0.0, "atol": 1e-5 if dtype == torch.float32 else 1e-4}
    if dtype == torch.float32:
        assert_fp32_close("out", out, ref)
    assert_close_to_reference("out", out, ref, ref64, **floor)
    for name in ("dq", "dk", "dv"):
        g, r, r64 = (split_qkv_grad(x)[name] for x in (grad, ref_grad, ref64_grad))
        assert_close_to_reference(name, g, r, r64, **floor)


# ------------------------------------------------------------------------------------------------ dropout


def test_dropout_mask_statistics_and_determinism():
    p = 0.3
    keep = pal_attention_dropout_mask(2, 3, 64, p, seed=1234, device=DEVICE)
    assert keep.shape == (2, 3, 64, 64) and keep.dtype == torch.bool
    fraction = keep.float().mean().item()
    assert abs(fraction - (1 - p)) < 0.02, fraction  # 24,576 draws: std 0.003
    assert torch.equal(keep, pal_attention_dropout_mask(2, 3, 64, p, seed=1234, device=DEVICE))
    other_seed = pal_attention_dropout_mask(2, 3, 64, p, seed=1235, device=DEVICE)
    assert (keep != other_seed).float().mean().item() > 0.3  # independent masks differ in 2p(1-p) = 42%
    flat = keep.view(6, -1).float()
    assert (
        (flat[:, None] - flat[None]).abs().mean(-1) + torch.eye(6, device=DEVICE)
    ).min().item() > 0.3  # heads/batches differ


def test_dropout_matches_masked_reference():
    p, heads, head_dim, lengths = 0.25, 2, 34, [19, 6, 1]
    qkv, q, k, v = packed_qkv(3, 19, heads, head_dim, seed=3)
    mask = ragged_mask(lengths, 19)
    keep = pal_attention_dropout_mask(3, heads, 19, p, seed=99, device=DEVICE)
    out_grad = randn(3, 19, heads, head_dim, seed=105)
    out, grad = out_and_grad(pal_attention(q, k, v, mask, dropout_p=p, generator_seed=99), qkv, out_grad)
    ref, ref_grad = out_and_grad(attention_with_keep_mask(q, k, v, mask, keep, p), qkv, out_grad)
    qkv64, q64, k64, v64 = float64_qkv(qkv, 3, 19, 3, heads, head_dim)
    ref64, ref64_grad = out_and_grad(
        attention_with_keep_mask(q64, k64, v64, mask, keep, p), qkv64, out_grad.double()
    )
    assert_fp32_matches("out", out, ref, ref64)
    assert_fp32_matches("dq, dk, dv", grad, ref_grad, ref64_grad)
    no_drop = attention_reference(q, k, v, mask)
    assert (out - no_drop).abs().max().item() > 0.1  # dropout did something

    # varlen: position (i, j) of sequence b draws the same counter as the padded batch with L = max_seqlen
    packed_rows = ragged_mask(lengths, 19).flatten().nonzero().squeeze(1)
    qv, kv, vv = (t.reshape(3 * 19, heads, head_dim)[packed_rows] for t in (q, k, v))
    cu = torch.tensor([0, 19, 25, 26], dtype=torch.int32, device=DEVICE)
    out_v = pal_attention_varlen(qv, kv, vv, cu, 19, dropout_p=p, generator_seed=99)
    # rows of padded keys never contribute, so the packed rows of the padded output must agree
    assert_fp32_close("varlen out", out_v, out.reshape(3 * 19, heads, head_dim)[packed_rows])
    (grad_v,) = torch.autograd.grad(out_v, qkv, out_grad.reshape(3 * 19, heads, head_dim)[packed_rows])
    (grad_p,) = torch.autograd.grad(
        attention_with_keep_mask(q, k, v, mask, keep, p).reshape(3 * 19, heads, head_dim)[packed_rows],
        qkv,
        out_grad.reshape(3 * 19, heads, head_dim)[packed_rows],
    )
    assert_fp32_close("varlen dq, dk, dv", grad_v, grad_p)


def test_dropout_seed_comes_from_torch_generator():
    qkv, q, k, v = packed_qkv(1, 16, 2, 17, seed=5)
    torch.manual_seed(11)
    first = pal_attention(q, k, v, dropout_p=0.5)
    second = pal_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(11)
    replay = pal_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(first, replay)
    assert not torch.equal(first, second)
    # p = 0: plain attention, no seed drawn
    state = torch.get_rng_state()
    assert_fp32_matches(
        "p=0",
        pal_attention(q, k, v, dropout_p=0.0),
        attention_reference(q, k, v),
        attention_with_keep_mask(q.double(), k.double(), v.double(), None),
    )
    assert torch.equal(state, torch.get_rng_state())


# ------------------------------------------------------------------------------------------------ validation


def test_validation_errors():
    q = torch.randn(2, 5, 2, 17, device=DEVICE)
    mask = torch.ones(2, 5, dtype=torch.bool, device=DEVICE)
    with pytest.raises(TypeError, match="q must be float32"):
        pal_attention(q.double(), q.double(), q.double())
    with pytest.raises(TypeError, match="k has dtype"):
        pal_attention(q, q.half(), q)
    with pytest.raises(ValueError, match="v must have the shape of q"):
        pal_attention(q, q, q[:, :4])
    with pytest.raises(ValueError, match=r"q must have shape \[B, L, H, Dh\]"):
        pal_attention(q[0], q[0], q[0])
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        pal_attention(q, None, q)
    big = torch.randn(1, 2, 1, MAX_HEAD_DIM + 1, device=DEVICE)
    with pytest.raises(ValueError, match="head dim"):
        pal_attention(big, big, big)
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        pal_attention(q, q, q, mask[:, :4])
    with pytest.raises(TypeError, match="key_padding_mask must be bool or integer"):
        pal_attention(q, q, q, mask.float())
    with pytest.raises(ValueError, match="dropout_p"):
        pal_attention(q, q, q, dropout_p=1.0)
    with pytest.raises(TypeError, match="generator_seed"):
        pal_attention(q, q, q, dropout_p=0.1, generator_seed=1.5)
    with pytest.raises(ValueError, match="softmax_scale"):
        pal_attention(q, q, q, softmax_scale=float("nan"))

    packed = torch.randn(6, 2, 17, device=DEVICE)
    good = torch.tensor([0, 2, 6], dtype=torch.int32, device=DEVICE)
    pal_attention_varlen(packed, packed, packed, good, 4)  # the valid call works
    # int32 and int64 boundaries follow one rule and give the same result
    assert torch.equal(
        pal_attention_varlen(packed, packed, packed, good.long(), 4),
        pal_attention_varlen(packed, packed, packed, good, 4),
    )
    with pytest.raises(TypeError, match="cu_seqlens must be int32 or int64"):
        pal_attention_varlen(packed, packed, packed, good.float(), 4)
    with pytest.raises(ValueError, match=r"cu_seqlens must have shape \[B\+1\]"):
        pal_attention_varlen(packed, packed, packed, good[None], 4)
    with pytest.raises(ValueError, match="non-decreasing"):
        pal_attention_varlen(
            packed, packed, packed, torch.tensor([0, 4, 2, 6], dtype=torch.int32, device=DEVICE), 4
        )
    with pytest.raises(ValueError, match="end at the number of packed rows 6"):
        pal_attention_varlen(
            packed, packed, packed, torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE), 4
        )
    with pytest.raises(ValueError, match="must start at 0"):
        pal_attention_varlen(
            packed, packed, packed, torch.tensor([1, 2, 6], dtype=torch.int32, device=DEVICE), 5
        )
    with pytest.raises(ValueError, match="max_seqlen"):
        pal_attention_varlen(packed, packed, packed, good, 3)
    with pytest.raises(ValueError, match=r"q must have shape \[N, H, Dh\]"):
        pal_attention_varlen(q, q, q, good, 4)
    if ON_CUDA:  # device mismatches need two devices
        with pytest.raises(ValueError, match="k is on cpu"):
            pal_attention(q, q.cpu(), q)  # host: a deliberate device mismatch
        with pytest.raises(ValueError, match="key_padding_mask is on cpu"):
            pal_attention(q, q, q, mask.cpu())  # host: a deliberate device mismatch
        with pytest.raises(ValueError, match="cu_seqlens is on cpu"):
            pal_attention_varlen(packed, packed, packed, good.cpu(), 4)  # host: a deliberate device mismatch


def test_reference_dropout_agrees_in_distribution():
    """Sanity link to F.dropout: the kernel's expected output equals the no-dropout output (unbiased scaling)."""
    torch.manual_seed(0)
    qkv, q, k, v = packed_qkv(1, 24, 1, 17, seed=2)
    outs = torch.stack([pal_attention(q, k, v, dropout_p=0.2, generator_seed=s) for s in range(48)])
    mean_err = (outs.mean(0) - attention_reference(q, k, v)).abs().mean().item()
    ref_outs = torch.stack([attention_reference(q, k, v, dropout_p=0.2) for _ in range(48)])
    ref_err = (ref_outs.mean(0) - attention_reference(q, k, v)).abs().mean().item()
    assert mean_err < 2 * ref_err + 1e-3, (mean_err, ref_err)
