"""The optional CUDA extension (csrc/): compiled with nvcc wherever nvcc exists, checked on a GPU when present."""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from fastpals import cuda_ext

CSRC = Path(__file__).resolve().parent.parent / "csrc"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_kernels_compile_with_nvcc(tmp_path):
    out = subprocess.run(
        ["nvcc", "-std=c++17", "-c", str(CSRC / "surgery_kernels.cu"), "-o", str(tmp_path / "k.o"),
         "-arch=sm_80", "-Werror", "all-warnings"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr


def test_unavailable_extension_says_why():
    ok, why = cuda_ext.available()
    if not torch.cuda.is_available():
        assert not ok and "CUDA" in why


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none present)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tasks", [1, 3, 8, 16])
def test_gram_and_combine_match_float64(dtype, tasks):
    g = torch.Generator(device="cuda").manual_seed(0)
    buf = torch.randn(tasks, 100_003, device="cuda", generator=g).to(dtype)
    G, finite = cuda_ext.gram(buf)
    ref = buf.double() @ buf.double().T
    torch.testing.assert_close(G.double(), ref, rtol=1e-5, atol=1e-3)
    assert bool(finite)
    w = torch.randn(tasks, device="cuda", generator=g)
    out = cuda_ext.combine(buf, w)
    ref_out = (w.double() @ buf.double()).to(dtype)
    torch.testing.assert_close(out, ref_out, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-2)
    buf[0, 7] = float("nan")
    assert not bool(cuda_ext.gram(buf)[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none present)")
def test_bad_buffers_raise():
    with pytest.raises(ValueError, match="task rows"):
        cuda_ext.gram(torch.zeros(17, 8, device="cuda"))
    with pytest.raises(TypeError, match="dtype"):
        cuda_ext.gram(torch.zeros(2, 8, device="cuda", dtype=torch.float64))
    with pytest.raises(ValueError, match="CUDA"):
        cuda_ext.gram(torch.zeros(2, 8))
