"""Fake ``cuda`` tensors on a CPU-only build of torch: :func:`load_runtime`, called before torch is imported,
loads a small C++ library (built once into ``~/.cache/fastpals`` with the system compiler) that registers a
no-op CUDA device guard and CUDA hooks that say "built, no device". Indexing, ``Tensor.to("cuda")`` and the
autograd engine then accept fake ``cuda`` tensors (the engine runs their backward on the calling thread); no
kernel can run on that device. Use it in a process of its own (``python -m bench.cuda_trace``): torch then
believes it was built with CUDA for the rest of that process.

This module imports no torch.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["load_runtime", "runtime_loaded"]

_SOURCE = """#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

// A CUDA device guard that does nothing and reports no device (the autograd engine then starts no device
// thread), and CUDA hooks that report a CUDA build (the engine's stream bookkeeping asks for one).
struct NoDeviceGuard final : c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA> {
  c10::DeviceIndex deviceCount() const noexcept override { return 0; }
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
};
C10_REGISTER_GUARD_IMPL(CUDA, NoDeviceGuard);

namespace fake_cuda {
struct CUDAHooks final : at::CUDAHooksInterface {
  CUDAHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return false; }
};
}  // namespace fake_cuda
namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", fake_cuda::CUDAHooks)
}
"""

_LOADED: list[ctypes.CDLL] = []


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("bench/fake_cuda.py: torch is not installed in this environment")
    return Path(next(iter(spec.submodule_search_locations)))


def runtime_loaded() -> bool:
    """:func:`load_runtime` has run in this process."""
    return bool(_LOADED)


def load_runtime() -> None:
    """Load the fake-CUDA runtime (see the module docstring); call it before ``import torch``."""
    if _LOADED:
        return
    if "torch" in sys.modules:
        raise RuntimeError(
            "bench.fake_cuda.load_runtime() must run before torch is imported (use a fresh process)"
        )
    torch_dir = _torch_dir()
    version = (torch_dir / "version.py").read_text().split("__version__ = ")[1].split("\n")[0].strip("'\" ")
    if "+cpu" not in version and (torch_dir / "lib" / "libtorch_cuda.so").exists():
        raise RuntimeError(f"bench/fake_cuda.py is for CPU-only builds of torch; this one is {version}")
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fastpals"
    lib = cache / f"fake_cuda-torch{version}.so"
    if not lib.exists():
        compiler = shutil.which(os.environ.get("CXX", "c++"))
        if compiler is None:
            raise RuntimeError("bench/fake_cuda.py needs a C++ compiler: install g++ or set CXX")
        cache.mkdir(parents=True, exist_ok=True)
        source = cache / "fake_cuda.cpp"
        source.write_text(_SOURCE)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run(
            [compiler, "-std=c++17", "-w", "-shared", "-fPIC", f"-I{torch_dir / 'include'}", str(source),
             f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", "-o", str(tmp)],
            check=True,
        )  # fmt: skip
        os.replace(tmp, lib)
    for name in ("libc10.so", "libtorch_cpu.so"):  # the registries the library writes into, then the library
        ctypes.CDLL(str(torch_dir / "lib" / name), mode=ctypes.RTLD_GLOBAL)
    _LOADED.append(ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL))
