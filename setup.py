"""Builds the compiled weight solve ``fastpals._C`` (``csrc/``) into the wheel when ``FASTPALS_BUILD_EXT=1``:
a ``CUDAExtension`` where nvcc and a CUDA build of torch are present, a ``CppExtension`` otherwise, with ninja.
Without it the wheel is pure Python and the op is built just in time on first use (fastpals.surgery.compiled).
The package's metadata stays in pyproject.toml."""

import os

from setuptools import setup


def extensions() -> tuple[list, dict]:
    if os.environ.get("FASTPALS_BUILD_EXT", "0") != "1":
        return [], {}
    import torch
    from torch.utils import cpp_extension

    csrc = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
    sources = ["csrc/solve_weights.cpp"]
    args = {"cxx": ["-O2", "-ffp-contract=off"]}
    if torch.version.cuda and cpp_extension.CUDA_HOME is not None:
        sources.append("csrc/solve_weights_cuda.cu")
        args["nvcc"] = ["-O2"]
        ext = cpp_extension.CUDAExtension(
            "fastpals._C", sources, include_dirs=[csrc], extra_compile_args=args
        )
    else:
        ext = cpp_extension.CppExtension("fastpals._C", sources, include_dirs=[csrc], extra_compile_args=args)
    build_ext = cpp_extension.BuildExtension.with_options(use_ninja=True, no_python_abi_suffix=True)
    return [ext], {"build_ext": build_ext}


ext_modules, cmdclass = extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
