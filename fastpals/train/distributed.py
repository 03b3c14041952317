"""Process set-up for DeepSpeed: rank/world defaults for ``python train.py``, quiet libraries, and no CPU
shared-memory comm op for a single process (DeepSpeed builds it with ninja, minutes the first time)."""

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


def set_single_process_env() -> None:
    """Defaults for ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (a free port) so
    that ``deepspeed.initialize`` works without the launcher; values set by a launcher are kept."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


@contextlib.contextmanager
def without_shm_comm_op() -> Iterator[None]:
    """While active, DeepSpeed's communication backend starts without its CPU shared-memory op
    (``deepspeed.comm.torch.build_shm_op`` returns None: "op not available")."""
    # by name: the attribute `deepspeed.comm.torch` is torch itself
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    original = ds_torch.build_shm_op
    ds_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch.build_shm_op = original


def quiet_libraries(verbose: bool = False) -> None:
    """Before DeepSpeed's import: name the CPU accelerator where there is no GPU (no guess, no warning) and
    keep transformers to errors; ``verbose``: DeepSpeed logs at INFO. Settings in the environment are kept."""
    if not verbose:
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        return
    from deepspeed.utils import logger  # DeepSpeed's import takes seconds

    logger.setLevel(logging.INFO)
    for handler in logger.handlers:
        handler.setLevel(logging.INFO)


def initialize(
    model: Any, optimizer: Any, scheduler: Any, config: dict, log: Any = print, verbose: bool = False
) -> tuple:
    """``deepspeed.initialize`` (``(engine, optimizer, loader, scheduler)``), without the shared-memory op for
    one process; without ``verbose``, what DeepSpeed prints is held back unless it fails."""
    quiet_libraries(verbose)
    import deepspeed  # its import takes seconds

    set_single_process_env()
    single = int(os.environ["WORLD_SIZE"]) == 1
    if not single and not torch.cuda.is_available():
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
        folder = Path(os.environ["TORCH_EXTENSIONS_DIR"])
        if not any(folder.glob("*/deepspeed_shm_comm/*.so")):
            log(f"[setup] building DeepSpeed's CPU shared-memory op once into {folder} (later runs reuse it)")
    held = io.StringIO()
    gc.freeze()  # DeepSpeed's set-up runs gc.collect() per parameter group: let it scan only new objects
    try:
        quiet = contextlib.redirect_stdout(sys.stdout if verbose else held)
        with without_shm_comm_op() if single else contextlib.nullcontext(), quiet:
            out = deepspeed.initialize(
                model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
            )
    except BaseException:
        sys.stdout.write(held.getvalue())
        raise
    finally:
        gc.unfreeze()
    engine = out[0]
    # one rank: DeepSpeed's fallback all-reduce (ZeRO-0, BF16_Optimizer) copies every gradient through a
    # bucket for an identity; ZeRO-1/2's reduce_gradients also moves gradients into place, so it stays
    reduces = hasattr(engine.optimizer, "reduce_gradients")
    if single and not reduces and not engine.zero_optimization_partition_gradients():
        engine.enable_backward_allreduce = False
    return out
