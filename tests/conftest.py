"""Test set-up: the tests' device comes from tests/device.py, which also turns Triton's interpreter on off CUDA
(imported here, before any test module loads Triton)."""

import os
from pathlib import Path

import device  # noqa: F401 - sets TRITON_INTERPRET off CUDA before a test module imports Triton
import pytest
import torch
from train_fixtures import make_tiny_data, make_tiny_model

torch.set_num_threads(min(2, os.cpu_count() or 1))


def data_dir() -> str:
    """The CS224N task files: $FASTPALS_DATA_DIR, else ../shared/data beside the checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.environ.get("FASTPALS_DATA_DIR", os.path.join(here, "..", "..", "shared", "data"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny task-data folder and encoder checkpoint (``train_fixtures``), made once per test module."""
    root = tmp_path_factory.mktemp("tiny")
    return make_tiny_data(root / "data"), make_tiny_model(root / "model")


@pytest.fixture
def task_data_dir() -> str:
    path = data_dir()
    if not os.path.isdir(path):
        pytest.fail(f"task data not found at {path}: set FASTPALS_DATA_DIR")
    return path


_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _launcher_variables_stay_in_their_test():
    """An in-process run (train.py's ``main``, ``Trainer(args).run()``) sets the launcher variables DeepSpeed reads
    in ``os.environ`` and keeps its process group's store listening on ``MASTER_PORT``. Put them back after each
    test, so a later test's ``train.py`` subprocess picks a free port of its own instead of inheriting that one
    (EADDRINUSE)."""
    before = {key: os.environ.get(key) for key in _LAUNCHER_VARIABLES}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def triton_mode(monkeypatch):
    """Run the ops' Triton path (interpreted off CUDA)."""
    monkeypatch.setenv("FASTPALS_KERNELS", "triton")
