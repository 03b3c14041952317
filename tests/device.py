"""The one device every kernel and GPU test runs on, and whether Triton runs interpreted.

``DEVICE`` is ``$FASTPALS_TEST_DEVICE`` when set (``cpu``, ``cuda``, ``cuda:1``), else CUDA when present, else the
CPU. Off CUDA the Triton kernels run in Triton's interpreter: ``TRITON_INTERPRET=1`` is set here, before Triton is
first imported (tests/conftest.py imports this module). Tests build inputs with a CPU ``torch.Generator`` and
move them with ``.to(DEVICE)``, so the values are the same on every device.
"""

import os
import re

import pytest
import torch

_requested = os.environ.get("FASTPALS_TEST_DEVICE", "").strip()
_default = "cuda" if torch.cuda.is_available() else "cpu"
DEVICE = torch.device(_requested if re.fullmatch(r"cpu|cuda(:\d+)?", _requested) else _default)
if _requested and str(DEVICE) != _requested:
    raise ValueError(
        f"FASTPALS_TEST_DEVICE={_requested!r}: the tests run on cpu or cuda[:N]; unset it or pick one"
    )
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    raise RuntimeError(
        f"FASTPALS_TEST_DEVICE={_requested!r} but torch sees no CUDA device; unset it to use the CPU"
    )

ON_CUDA = DEVICE.type == "cuda"
if not ON_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
#: the Triton kernels are defined as interpreted functions (Triton reads the variable when a kernel is defined)
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

requires_cuda = pytest.mark.skipif(not ON_CUDA, reason=f"needs a CUDA GPU (the tests run on {DEVICE})")
