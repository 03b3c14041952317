"""Counts the calls of ``torch.Tensor``'s host-read methods (``.item()``, ``.tolist()``, ``float(t)``, ``int(t)``,
``bool(t)``, ``operator.index(t)``) by the file and line that made them (the immediate caller), as
``/work/shared/tools/host_reads.py`` does for a whole step. Used by ``tests/test_train_update.py``, also in its
subprocess."""

from __future__ import annotations

import collections
import sys
from typing import Any

import torch

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")


class HostReads:
    """``with HostReads() as reads:`` wraps the methods (restored on exit); calls are counted while
    ``reads.active`` is true, in ``reads.counts[(path, line, method)]``."""

    def __init__(self, names: tuple[str, ...] = READS) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.active = False
        self.originals = {n: getattr(torch.Tensor, n) for n in names}

    def __enter__(self) -> HostReads:
        for name, orig in self.originals.items():
            setattr(torch.Tensor, name, self._wrap(name, orig))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, orig in self.originals.items():
            setattr(torch.Tensor, name, orig)

    def _wrap(self, name: str, orig: Any) -> Any:
        def wrapped(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.active:
                caller = sys._getframe(1)
                path = caller.f_code.co_filename.replace("\\", "/")
                self.counts[(path, caller.f_lineno, name)] += 1
            return orig(tensor, *args, **kwargs)

        return wrapped

    def under(self, folder: str) -> dict[str, int]:
        """``{"<path from folder>:<line> <method>": calls}`` of the calls made by files whose path holds
        ``folder`` (e.g. ``"/fastpals/train/"``)."""
        return {
            f"{p[p.rfind(folder) + 1 :]}:{line} {n}": c
            for (p, line, n), c in self.counts.items()
            if folder in p
        }
