"""The built wheel holds the Python API ``fastpals`` and the top-level folder ``kernels/`` as the import package
``fastpals_kernels`` (not ``kernels``, a name another PyPI project owns), and the source tree imports from where
it is laid out."""

import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_wheel_contains_kernels_as_fastpals_kernels(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", str(tmp_path), ROOT],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("fastpals-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    kernel_dir = os.path.join(ROOT, "kernels")
    kernel_sources = sorted(f for f in os.listdir(kernel_dir) if f.endswith(".py"))
    assert "__init__.py" in kernel_sources and "dispatch.py" in kernel_sources
    for f in kernel_sources:
        assert f"fastpals_kernels/{f}" in names, f"kernels/{f} missing from the wheel"
    assert not any(n.startswith(("kernels/", "bench/", "tests/")) for n in names), "stray top-level package"
    for folder, _, files in os.walk(os.path.join(ROOT, "fastpals")):  # every module of every subpackage
        rel = os.path.relpath(folder, ROOT)
        for f in files:
            if f.endswith(".py"):
                assert f"{rel}/{f}" in names, f"{rel}/{f} missing from the wheel (pyproject.toml packages)"
    for f in (
        "fastpals/__init__.py",
        "fastpals/model.py",
        "fastpals/functional.py",
        "fastpals/surgery/__init__.py",
    ):
        assert f in names
    assert not any(n.endswith((".so", ".cu", ".cpp")) for n in names), "no compiled extension is shipped"
    recipes = sorted(
        f for f in os.listdir(os.path.join(ROOT, "fastpals", "configs", "recipes")) if f.endswith(".json")
    )
    assert recipes and all(
        f"fastpals/configs/recipes/{f}" in names for f in recipes
    )  # --recipe NAME from a wheel


def test_kernels_import_as_laid_out():
    import fastpals_kernels

    assert os.path.samefile(os.path.dirname(fastpals_kernels.__file__), os.path.join(ROOT, "kernels"))
    assert not os.path.exists(os.path.join(ROOT, "setup.py")), "pyproject.toml alone describes the build"
    assert type(sys.modules["fastpals_kernels"]).__name__ == "module", "no module-class patching"


def test_reference_ops_import_without_triton():
    """fastpals.functional and the surgery buffer (its CPU path) work where Triton is not installed."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "import fastpals.functional as F\n"
        "from fastpals.surgery import TaskGradientBuffer\n"
        "from fastpals_kernels import gram, combine\n"
        "b = torch.randn(3, 10)\n"
        "g, ok = gram(b)\n"
        "assert torch.allclose(g, b @ b.T, atol=1e-5) and bool(ok.all())\n"
        "assert torch.allclose(combine(b, torch.ones(3)), b.sum(0), atol=1e-6)\n"
        "assert 'triton' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_the_kernels_folder_does_not_pass_for_hugging_face_kernels():
    """Run from the repository root (the folder ``kernels/`` on ``sys.path``), transformers' probe for Hugging
    Face's ``kernels`` package still answers no, without an error."""
    pytest.importorskip("transformers")
    code = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('kernels') is not None  # the folder is visible from here\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "print(is_kernels_available())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
