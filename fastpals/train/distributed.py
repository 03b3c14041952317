"""Process set-up for DeepSpeed: rank/world defaults for ``python train.py``, quiet libraries, and no
shared-memory comm op build for a single process.

DeepSpeed's ``TorchBackend`` builds its CPU shared-memory all-reduce op (``deepspeed_shm_comm``) with ninja when
the communication backend starts, which takes minutes the first time (``docs/measurements.md``, Start-up). One process never all-reduces across
processes, so :func:`initialize` starts DeepSpeed without that op there; several CPU ranks build it once into
``$TORCH_EXTENSIONS_DIR`` (default: inside the Python environment). ``--verbose`` keeps the libraries' output.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import logging
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["initialize", "quiet_libraries", "set_single_process_env", "without_shm_comm_op"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_single_process_env() -> None:
    """Defaults for ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (a free port) so
    that ``deepspeed.initialize`` works without the launcher; values set by a launcher are kept."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())


@contextlib.contextmanager
def without_shm_comm_op() -> Iterator[None]:
    """While active, DeepSpeed's communication backend starts without building/loading its CPU shared-memory
    op (``deepspeed.comm.torch.build_shm_op`` returns None, which DeepSpeed handles as "op not available")."""

    # `deepspeed.comm.torch` the attribute is torch
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    original = ds_torch.build_shm_op
    ds_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch.build_shm_op = original


def _private_extensions_dir(log: Any) -> None:
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(sys.prefix) / "torch_extensions")
    folder = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    if not any(folder.glob("*/deepspeed_shm_comm/*.so")):
        log(
            f"[setup] building DeepSpeed's CPU shared-memory op once into {folder} (about 90 s; later runs reuse it)"
        )


def quiet_libraries(verbose: bool = False) -> None:
    """Before DeepSpeed is imported: without ``verbose``, name the CPU accelerator where there is no CUDA device
    (DeepSpeed would guess it, with a warning) and keep transformers to errors; with ``verbose``, DeepSpeed logs
    at INFO. Settings already in the environment are kept."""

    if not verbose:
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        return
    from deepspeed.utils import logger  # DeepSpeed's import takes seconds

    logger.setLevel(logging.INFO)
    for handler in logger.handlers:
        handler.setLevel(logging.INFO)


@contextlib.contextmanager
def _held_stdout(hold: bool) -> Iterator[None]:
    """While active (``hold``), what is printed to stdout is kept; it is printed only if the block raises."""
    if not hold:
        yield
        return
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    except BaseException:
        sys.stdout.write(buffer.getvalue())
        raise


@contextlib.contextmanager
def _gc_sees_only_new_objects() -> Iterator[None]:
    """While active, the objects alive at entry sit in the garbage collector's permanent generation (``gc.freeze``).
    DeepSpeed's set-up reports memory with ``gc.collect()`` per parameter group (10 full collections with the bf16
    optimizer): each scans every object of the process, about 0.3 s in a fresh ``train.py`` and seconds in a long
    test session. Frozen objects are not freed meanwhile; ``gc.unfreeze`` gives them back to the collector."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def initialize(
    model: Any,
    optimizer: Any,
    scheduler: Any,
    config: dict[str, Any],
    log: Any = print,
    verbose: bool = False,
) -> tuple:
    """``deepspeed.initialize`` for this process: without the shared-memory op when it is the only process (or
    on CUDA, where NCCL does the collectives); returns DeepSpeed's ``(engine, optimizer, loader, scheduler)``.
    Without ``verbose``, what DeepSpeed prints while it sets up (memory reports) is held back, unless it fails."""
    quiet_libraries(verbose)
    import deepspeed  # its import takes seconds

    set_single_process_env()
    single = int(os.environ["WORLD_SIZE"]) == 1
    if not single and not torch.cuda.is_available():
        _private_extensions_dir(log)
    context = without_shm_comm_op() if single else contextlib.nullcontext()
    with context, _held_stdout(not verbose), _gc_sees_only_new_objects():
        out = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    engine = out[0]
    if (
        single
        and not hasattr(engine.optimizer, "reduce_gradients")
        and not engine.zero_optimization_partition_gradients()
    ):
        # One rank: DeepSpeed's fallback all-reduce (taken with ZeRO-0 and with BF16_Optimizer) would flatten every
        # gradient into a bucket, all-reduce it over one rank and copy it back, about 9 ms an update for MiniLM's
        # 9 M trainable weights; over one rank it is the identity, so the backward skips it. (The ZeRO-1/2
        # optimizers' reduce_gradients also moves their gradients into place, so it stays.)
        engine.enable_backward_allreduce = False
    return out
