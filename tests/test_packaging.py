"""The built wheel holds the Python API and the Triton kernels as ``fastpals.kernels`` (not a top-level
``kernels`` package, a name another PyPI project owns)."""

import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_wheel_contains_kernels_under_fastpals(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", str(tmp_path), ROOT],
        check=True,
        capture_output=True,
        env={**os.environ, "FASTPALS_BUILD_CUDA": "0"},
    )
    (wheel,) = tmp_path.glob("fastpals-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    kernel_sources = sorted(f for f in os.listdir(os.path.join(ROOT, "kernels")) if f.endswith(".py"))
    assert kernel_sources
    for f in kernel_sources:
        assert f"fastpals/kernels/{f}" in names, f"kernels/{f} missing from the wheel"
    assert not any(n.startswith("kernels/") for n in names), "a top-level kernels package would clash on PyPI"
    for f in ("fastpals/__init__.py", "fastpals/model.py", "fastpals/surgery/__init__.py"):
        assert f in names
    recipes = sorted(
        f for f in os.listdir(os.path.join(ROOT, "fastpals", "configs", "recipes")) if f.endswith(".json")
    )
    assert recipes and all(
        f"fastpals/configs/recipes/{f}" in names for f in recipes
    )  # --recipe NAME from a wheel


def test_kernels_import_as_fastpals_kernels():
    import fastpals.kernels

    assert os.path.samefile(os.path.dirname(fastpals.kernels.__file__), os.path.join(ROOT, "kernels"))
