"""The backend decision (fastpals_kernels.dispatch.decide) for each GPU generation and the $FASTPALS_KERNELS
override (the PAL's stock-composition path against the reference: tests/kernels/test_pal_op.py)."""

import importlib

import pytest
import torch
from device import TRITON_INTERPRETED

from fastpals_kernels import dispatch
from fastpals_kernels.common import load_triton
from fastpals_kernels.dispatch import OPS, decide

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
T4, A100, H100 = (7, 5), (8, 0), (9, 0)


@pytest.mark.parametrize("dtype", [FP32, FP16, BF16])
def test_cpu_runs_the_reference(dtype):
    for op in OPS:
        choice = decide(op, None, dtype)
        expected = "sdpa" if op == "bert_attention_varlen" else "reference"
        assert choice.backend == expected and "CPU" in choice.reason


def test_sm75_takes_tensor_core_stock_ops():
    """T4: Triton emits no mma there, so the PAL and its attention take cuBLAS + SDPA; bf16 has no tensor cores."""
    for op in ("pal", "pal_attention"):
        got = decide(op, T4, FP16)
        assert got.backend == "sdpa" and "no mma" in got.reason and "sm_75" in got.reason
    assert decide("grouped_linear", T4, FP16).backend == "reference"
    assert decide("pal", T4, BF16).backend == "reference" and "bf16" in decide("pal", T4, BF16).reason
    # memory-bound ops need no tensor cores
    assert decide("gram", T4, FP16).backend == "triton"
    assert decide("combine", T4, FP32).backend == "triton"
    # flash-attn 2 needs sm_80
    assert decide("bert_attention_varlen", T4, FP16, flash_attn=True).backend == "sdpa"


@pytest.mark.parametrize("cap", [A100, H100])
@pytest.mark.parametrize("dtype", [FP32, FP16, BF16])
def test_sm80_and_sm90_take_triton(cap, dtype):
    for op in ("pal", "grouped_linear", "pal_attention", "gram", "combine"):
        got = decide(op, cap, dtype)
        assert got.backend == "triton", (op, got)
        assert got.reason
    half = dtype != FP32
    flash = decide("bert_attention_varlen", cap, dtype, flash_attn=True)
    assert flash.backend == ("flash_attn" if half else "sdpa")
    assert decide("bert_attention_varlen", cap, dtype, flash_attn=False).backend == "sdpa"


def test_pre_volta_and_bad_arguments():
    assert decide("gram", (6, 1), FP32).backend == "reference"
    assert decide("pal", (6, 1), FP16).backend == "sdpa"
    with pytest.raises(ValueError, match="op must be one of"):
        decide("softmax", A100, FP16)
    with pytest.raises(ValueError, match="dtype must be"):
        decide("pal", A100, torch.float64)


def test_backend_follows_the_env_override(monkeypatch):
    load_triton(
        vars(importlib.import_module("fastpals_kernels.grouped_linear"))
    )  # kernels defined before the change

    x = torch.zeros(2)
    monkeypatch.setenv("FASTPALS_KERNELS", "reference")
    assert dispatch.backend("pal", x) == "reference"
    monkeypatch.setenv("FASTPALS_KERNELS", "auto")
    assert dispatch.backend("pal", x) == "reference"  # CPU tensor
    monkeypatch.setenv("FASTPALS_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if TRITON_INTERPRETED:  # the kernels are interpreted functions: a CPU tensor may run them
        assert dispatch.backend("gram", x) == "triton"
    else:  # compiled for the GPU: setting the variable now is too late, and the dispatch says so
        with pytest.raises(RuntimeError, match="loaded before TRITON_INTERPRET=1"):
            dispatch.backend("gram", x)
    assert dispatch.backend("bert_attention_varlen", x) == "sdpa"
    assert not dispatch.flash_varlen_ok(x)
