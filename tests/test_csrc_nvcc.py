"""The CUDA half of the compiled weight solve (``csrc/solve_weights_kernel.cuh``) compiled with nvcc, without
torch headers, for sm_75, sm_80 and sm_90 with ``-Xptxas -v`` (nothing runs): every kernel instantiation
(double for each, float for sm_90) must use at most 128 registers per thread, spill nothing, and keep its
static shared memory within the architecture's per-block limit. The T x T problem's dynamic shared memory is asked for by the
launcher (``solve_weights_cuda.cu``) only where it fits the device's opt-in limit (read at run time); beyond
(T = 128 in fp64 on every architecture here), the kernel works in a global workspace."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parent.parent / "csrc"
ARCHS = ("75", "80", "90")
#: opt-in shared memory per block (bytes): Turing 64 KiB, A100 163 KiB, H100 227 KiB
SMEM_LIMIT = {"75": 64 * 1024, "80": 163 * 1024, "90": 227 * 1024}
MAX_REGISTERS = 128

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")

# the launcher's double kernel for every architecture; the float one (same template) for the newest only
INSTANTIATE = """
#include "solve_weights_kernel.cuh"
template __global__ void fastpals::solve_weights_kernel<double>(
    int, const double*, int, const double*, double, double, double, double*, double*, bool, double*);
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
template __global__ void fastpals::solve_weights_kernel<float>(
    int, const float*, int, const float*, float, float, float, float*, float*, bool, float*);
#endif
"""


def test_ptxas_registers_spills_and_shared_memory(tmp_path):
    src = tmp_path / "kernel.cu"
    src.write_text(INSTANTIATE)
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    cmd = ["nvcc", "-c", str(src), "-o", str(tmp_path / "kernel.o"), f"-I{CSRC}", "-O2", "-Xptxas", "-v",
           "-Werror", "all-warnings", *gencode]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    entries = re.findall(
        r"Compiling entry function '(\w+)' for 'sm_(\d+)'.*?(\d+) bytes spill stores, (\d+) bytes spill loads"
        r".*?Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?",
        log, re.S,
    )  # fmt: skip
    assert len(entries) == len(ARCHS) + 1, log[-4000:]
    for name, arch, stores, loads, regs, smem in entries:
        where = f"{name} on sm_{arch}"
        assert int(stores) == 0 and int(loads) == 0, f"{where} spills ({stores} B stored, {loads} B loaded)"
        assert int(regs) <= MAX_REGISTERS, f"{where} uses {regs} registers per thread (> {MAX_REGISTERS})"
        assert int(smem or 0) <= SMEM_LIMIT[arch], f"{where} uses {smem} B of static shared memory"
