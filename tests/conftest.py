"""Test set-up: on machines without CUDA, Triton kernels run in interpreter mode (set before triton loads)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, os.cpu_count() or 1))

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (none present)")


def data_dir() -> str:
    """The CS224N task files: $FASTPALS_DATA_DIR, else ../shared/data beside the checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.environ.get("FASTPALS_DATA_DIR", os.path.join(here, "..", "..", "shared", "data"))


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
