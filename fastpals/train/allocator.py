"""Keep freed host memory in the process during training (glibc ``malloc`` tuning): with glibc's defaults a CPU
step's large blocks are mapped fresh and unmapped on free, so each update pays page faults again."""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

__all__ = ["MMAP_THRESHOLD", "keep_freed_memory"]

# mallopt parameter numbers (glibc malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3

#: blocks up to this size come from the heap and are reused (older glibc refuses more than 32 MiB)
MMAP_THRESHOLD = 1 << 30
_OLD_GLIBC_MMAP_MAX = 32 * 1024 * 1024
_TRIM_THRESHOLD = 2**31 - 1  # int max: never give the heap top back
_TOP_PAD = 64 * 1024 * 1024


def keep_freed_memory() -> bool:
    """Raise glibc's mmap threshold and stop trimming, so freed blocks are reused. True when every
    setting was taken; False without glibc (macOS, Windows, musl) or where glibc refused one."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap_ok = (
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        or mallopt(_M_MMAP_THRESHOLD, _OLD_GLIBC_MMAP_MAX) == 1
    )
    return mmap_ok and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1 and mallopt(_M_TOP_PAD, _TOP_PAD) == 1
