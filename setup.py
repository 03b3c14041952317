"""Build script: the Python API lives in fastpals/, the Triton kernels in kernels/ (installed as
fastpals.kernels), and the optional CUDA extension in csrc/ (built only where CUDA and ninja exist)."""

import os

from setuptools import setup

packages = ["fastpals", "fastpals.surgery", "fastpals.train", "fastpals.kernels"]
package_dir = {"fastpals": "fastpals", "fastpals.kernels": "kernels"}

ext_modules = []
cmdclass = {}
if os.environ.get("FASTPALS_BUILD_CUDA", "auto") != "0":
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

        sources = [os.path.join("csrc", f) for f in sorted(os.listdir("csrc")) if f.endswith((".cu", ".cpp"))]
        if torch.cuda.is_available() and CUDA_HOME is not None and sources:
            ext_modules.append(CUDAExtension("fastpals._C", sources, extra_compile_args={"nvcc": ["-O3"]}))
            cmdclass["build_ext"] = BuildExtension
    except ImportError:
        pass

setup(
    packages=packages,
    package_dir=package_dir,
    # the DeepSpeed configs and the recipes, usable by name from a wheel
    package_data={"fastpals": ["configs/*.json", "configs/recipes/*.json"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
