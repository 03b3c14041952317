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
