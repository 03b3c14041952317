"""Just-in-time builds of the C++/CUDA sources in a checkout's top-level ``csrc/`` (torch's ``cpp_extension`` with
ninja), cached per Python, torch and CUDA version and rebuilt when a source changes."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

#: the C++/CUDA sources (a checkout's top-level ``csrc/``; absent from an installed wheel)
CSRC = Path(__file__).resolve().parents[1] / "csrc"


def extension_cache_dir() -> Path:
    """Where the just-in-time builds live: ``$XDG_CACHE_HOME/fastpals/extensions/<python>-<torch>-<cpu|cuXY>``."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastpals" / "extensions"
    flavour = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return root / f"{python}-torch{torch.__version__.split('+')[0]}-{flavour}"


@contextlib.contextmanager
def build_lock(build: Path) -> Iterator[None]:
    """Serialise builds with an OS lock that dies with its holder, and clear the ``lock`` file a killed build
    leaves behind (torch's build would wait on it forever)."""
    try:
        import fcntl  # not on Windows: torch's own lock file only
    except ImportError:
        yield
        return
    with open(build / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        yield


def build(
    name: str,
    sources: Sequence[str],
    cuda_sources: Sequence[str] = (),
    cflags: Sequence[str] = (),
    ldflags: Sequence[str] = (),
) -> str:
    """Build (or load the cached build of) the ops library ``name`` from ``csrc/`` files, the CUDA ones only
    where CUDA is there, and load it into ``torch.ops``. Returns how it was built, for a log line."""
    from torch.utils import cpp_extension

    with_cuda = bool(cuda_sources) and torch.cuda.is_available() and cpp_extension.CUDA_HOME is not None
    files = [str(CSRC / f) for f in (*sources, *(cuda_sources if with_cuda else ()))]
    directory = extension_cache_dir() / name
    directory.mkdir(parents=True, exist_ok=True)
    with build_lock(directory):
        cpp_extension.load(
            name=name,
            sources=files,
            extra_cflags=["-O2", *cflags],
            extra_cuda_cflags=["-O2"],
            extra_ldflags=list(ldflags),
            extra_include_paths=[str(CSRC)],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    kind = "C++ and CUDA" if with_cuda else "C++"
    return f"({kind}) built just in time with ninja, cached in {directory} (rebuilt when csrc/ changes)"
