"""The PAL op (fastpals_kernels.pal): the fused PAL (pal / pal_varlen) against fastpals.functional.pal_reference,
the custom ops torch.ops.fastpals.pal / pal_varlen (opcheck, references, dropout replay), run_pal's backends, the
package API and the FASTPALS_KERNELS switch (the attention kernels: test_pal_attention.py).

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
from device import DEVICE, TRITON_INTERPRETED, requires_cuda
from tolerances import assert_close_to_reference, assert_fp32_close
from torch.library import opcheck

import fastpals_kernels as kernels
from fastpals.functional import (
    grouped_linear_reference,
    pal_reference,
    pal_varlen_reference,
)
from fastpals_kernels import backends as kernel_backends
from fastpals_kernels import library
from fastpals_kernels.common import load_triton
from fastpals_kernels.pal import run_pal
from fastpals_kernels.pal_attention import pal_attention_dropout_mask

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
    assert kernels.pal_attention.__module__ == "fastpals_kernels.pal_attention"
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
# torch.ops.fastpals.pal / pal_varlen (opcheck, the references, dropout replay) and run_pal's backends
# ==============================================================================================================
def _op_case(dtype):
    """A padded batch of 4 x 7 tokens (d = 16, d_s = 12, 3 tasks) on the CPU, its packed rows and cu_seqlens."""
    g = torch.Generator().manual_seed(0)
    weights = [w.detach().cpu().requires_grad_() for w in _weights(3, 16, 12, dtype, g)]
    h = (torch.randn(4, 7, 16, generator=g) * 0.2).to(dtype).requires_grad_()  # host: CPU op
    mask = torch.ones(4, 7, dtype=torch.bool)  # host: CPU op
    mask[1, 4:] = False
    mask[3, 2:] = False
    cu = torch.tensor([0, 7, 11, 18, 20])  # host: CPU op
    return h, mask, torch.tensor([2, 0, 1, 2]), weights, cu, g  # host: CPU op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_pal_opcheck(dtype, residual, dropout_p):
    h, mask, task_ids, weights, _, g = _op_case(dtype)
    res = torch.randn(h.shape, generator=g).to(dtype).requires_grad_() if residual else None  # host: CPU op
    args = (h, mask, task_ids, *weights, 2, True, dropout_p, res, library.draw_seed())
    opcheck(torch.ops.fastpals.pal.default, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pal_varlen_opcheck(dtype):
    _, _, task_ids, weights, cu, g = _op_case(dtype)
    rows = torch.randn(20, 16, generator=g).to(dtype).requires_grad_()  # host: CPU op
    for res in (None, torch.randn(20, 16, generator=g).to(dtype).requires_grad_()):  # host: CPU op
        args = (rows, cu, 7, task_ids, *weights, 2, False, 0.1, res, library.draw_seed())
        opcheck(torch.ops.fastpals.pal_varlen.default, args)


def test_pal_backward_op_leaves_the_residual_out():
    """The residual's gradient is the incoming one: the backward op recomputes only h's and the six weights'."""
    h, mask, task_ids, weights, _, g = _op_case(torch.float32)
    res = torch.randn(h.shape, generator=g).requires_grad_()  # host: CPU op
    grad, seed = torch.randn(h.shape, generator=g), library.draw_seed()  # host: CPU op
    inputs = [t.detach() for t in (h, mask, task_ids, *weights)]
    assert len(torch.ops.fastpals.pal_backward(grad, *inputs, 2, True, 0.0, res.detach(), seed)) == 7
    out = torch.ops.fastpals.pal(h, mask, task_ids, *weights, 2, True, 0.0, res, seed)
    torch.testing.assert_close(torch.autograd.grad(out, res, grad)[0], grad, rtol=0, atol=0)


@pytest.mark.parametrize("packed", [False, True])
def test_pal_ops_match_the_reference_in_output_and_every_gradient(packed):
    h, mask, task_ids, weights, cu, g = _op_case(torch.float32)
    res = torch.randn(h.shape, generator=g).requires_grad_()  # host: CPU op
    seed = library.draw_seed()
    if packed:
        h, res = h[mask].detach().requires_grad_(), res[mask].detach().requires_grad_()
        got = torch.ops.fastpals.pal_varlen(h, cu, 7, task_ids, *weights, 2, True, 0.0, res, seed)
        want = res + pal_varlen_reference(h, cu, 7, task_ids, *weights, 2, True, 0.0)
    else:
        got = torch.ops.fastpals.pal(h, mask, task_ids, *weights, 2, True, 0.0, res, seed)
        want = res + pal_reference(h, mask, task_ids, *weights, 2, True, 0.0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    grad = torch.randn(got.shape, generator=g)  # host: CPU op
    for a, b in zip(_grads(got, [h, *weights, res], grad), _grads(want, [h, *weights, res], grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_pal_op_dropout_replays_its_mask_in_the_backward():
    """The backward recomputes the forward: the same seed gives the same mask, so the gradient is that of the
    forward that ran (checked against autograd through the reference under the same seed)."""
    h, mask, task_ids, weights, _, g = _op_case(torch.float32)
    seed = torch.tensor([1234])  # host: CPU op
    got = torch.ops.fastpals.pal(h, mask, task_ids, *weights, 2, True, 0.3, None, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        want = pal_reference(h, mask, task_ids, *weights, 2, True, 0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    grad = torch.randn(got.shape, generator=g)  # host: CPU op
    for a, b in zip(_grads(got, [h, *weights], grad), _grads(want, [h, *weights], grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    seed = torch.tensor([99])  # host: CPU op
    other = torch.ops.fastpals.pal(h, mask, task_ids, *weights, 2, True, 0.3, None, seed)
    assert not torch.equal(other, got)


def test_pal_sdpa_path_matches_the_reference_fp32():
    g = torch.Generator().manual_seed(0)
    weights = [w.detach().cpu() for w in _weights(3, 24, 34, torch.float32, g)]
    h = torch.randn(4, 9, 24, generator=g)  # host: CPU op
    mask = torch.ones(4, 9, dtype=torch.bool)  # host: CPU op
    mask[1, 5:] = False
    task_ids = torch.tensor([2, 0, 1, 2])  # host: CPU op
    ref = pal_reference(h, mask, task_ids, *weights, 2)
    sdpa = pal_reference(h, mask, task_ids, *weights, 2, attention="sdpa")
    assert (ref - sdpa).abs().max().item() <= 1e-5
    cu = torch.tensor([0, 9, 14, 23, 32])  # host: CPU op
    packed = pal_varlen_reference(h[mask], cu, 9, task_ids, *weights, 2, attention="sdpa")
    assert (packed - ref[mask]).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="attention must be"):
        pal_reference(h, mask, task_ids, *weights, 2, attention="flash")


def test_run_pal_adds_the_residual_on_every_backend(monkeypatch):
    g = torch.Generator().manual_seed(1)
    weights = [w.detach().cpu() for w in _weights(2, 16, 12, torch.float32, g)]
    h, res = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g)  # host: CPU op
    mask = torch.ones(2, 5, dtype=torch.bool)  # host: CPU op
    args = (torch.tensor([1, 0]), *weights, 2, True, 0.0)  # host: CPU op
    want = res + pal_reference(h, mask, *args)
    for choice in ("reference", "sdpa"):
        monkeypatch.setattr(sys.modules["fastpals_kernels.pal"], "backend", lambda op, t, c=choice: c)
        got = run_pal(h, args, mask=mask, residual=res)
        assert (got - want).abs().max().item() <= 1e-5, choice
        assert (run_pal(h, args, mask=mask) - (want - res)).abs().max().item() <= 1e-5
