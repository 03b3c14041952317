"""The built wheel holds the Python API ``fastpals`` and the top-level folder ``kernels/`` as the import package
``fastpals_kernels`` (not ``kernels``, a name another PyPI project owns), builds without setuptools warnings, and,
installed into a fresh environment outside the checkout, runs ``fastpals --help``, ``python -m fastpals.env`` and
a short ``fastpals train`` with the shipped configs and recipes; the source tree imports from where it is laid
out."""

import json
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_fixtures import make_tiny_data, make_tiny_model  # noqa: E402

# variables that would point a subprocess at the checkout, or that make setuptools warn about byte-compiling
CHECKOUT_ENV = ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in CHECKOUT_ENV}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``python -m build --wheel`` of the checkout: the wheel's path and the build's output."""
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", str(out), ROOT],
        capture_output=True, text=True, env=_env(), timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (wheel,) = out.glob("fastpals-*.whl")
    return wheel, proc.stdout + proc.stderr


def test_the_build_gives_no_warnings(built):
    _, log = built
    warnings = [line for line in log.splitlines() if "warning" in line.lower()]
    assert not warnings, "\n".join(warnings)


def test_wheel_contains_kernels_as_fastpals_kernels(built):
    wheel, _ = built
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
        "fastpals/encoder/bert.py",
        "fastpals/functional.py",
        "fastpals/surgery/__init__.py",
    ):
        assert f in names
    # the compiled weight solve ships only when asked (FASTPALS_BUILD_EXT=1: tests/test_compiled_solve.py)
    assert not any(n.endswith((".so", ".cu", ".cpp")) for n in names), "no compiled extension is shipped"
    recipes = sorted(
        f for f in os.listdir(os.path.join(ROOT, "fastpals", "configs", "recipes")) if f.endswith(".json")
    )
    assert recipes and all(
        f"fastpals/configs/recipes/{f}" in names for f in recipes
    )  # --recipe NAME from a wheel


@pytest.mark.slow
def test_the_installed_wheel_trains_with_its_shipped_configs(built, tmp_path):
    """A fresh venv outside the checkout gets the wheel (no network: ``--no-deps``; the dependencies come from
    this environment's site-packages through a ``.pth`` line, which does not run that environment's own
    ``.pth`` files, so an editable install there stays out of sight); from a folder outside the checkout it runs
    ``fastpals --help``, ``python -m fastpals.env`` and 3 updates of ``fastpals train --recipe
    baseline_multitask --ds_config cpu_auto.json``, both found in the installed package."""
    wheel, _ = built
    env_dir, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    python = env_dir / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python)]  # this pip, installing into the new venv
    install = subprocess.run([*pip, "install", "--no-deps", "--no-index", "-q", str(wheel)], capture_output=True,
                             text=True, env=_env(), timeout=600)  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    Path(site, "_deps_from_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    def run(*cmd: str) -> str:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work, env=_env(), timeout=900)
        assert proc.returncode == 0, f"{cmd}:\n{(proc.stdout + proc.stderr)[-4000:]}"
        return proc.stdout + proc.stderr

    where = run(str(python), "-c", "import fastpals, fastpals_kernels; print(fastpals.__file__); "
                "print(fastpals_kernels.__file__)").split()  # fmt: skip
    assert all(Path(f).is_relative_to(site) for f in where), f"not the installed wheel: {where}"
    assert "train" in run(str(env_dir / "bin" / "fastpals"), "--help")
    assert "torch" in run(str(python), "-m", "fastpals.env")
    data, model = make_tiny_data(tmp_path / "data"), make_tiny_model(tmp_path / "model")
    out = work / "run"
    log = run(str(env_dir / "bin" / "fastpals"), "train", "--recipe", "baseline_multitask", "--ds_config",
              "cpu_auto.json", "--model", str(model), "--data-dir", str(data), "--out", str(out),
              "--epochs", "1", "--steps-per-epoch", "3", "--batch-size", "8", "--max-length", "24",
              "--max-eval", "16", "--max-predict", "8", "--no-progress")  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == 3 and results["config"]["pal"] == "none", log[-2000:]  # the recipe's options


def test_kernels_import_as_laid_out():
    import fastpals_kernels

    assert os.path.samefile(os.path.dirname(fastpals_kernels.__file__), os.path.join(ROOT, "kernels"))
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
