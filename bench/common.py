"""Measurement helpers shared by the benchmark suites: timing, peak memory (GPU and CPU), and results files.

- Time: :class:`StepTimer` wraps a callable and records the wall time of every call, synchronising the CUDA
  device after it, so that pytest-benchmark's calls and our own records are the same measurements.
- GPU peak memory: :class:`CudaPeakMemory`, ``torch.cuda.max_memory_allocated`` after
  ``torch.cuda.reset_peak_memory_stats``: every tensor the caching allocator handed out (weights included),
  not the cache around them.
- CPU peak memory: :class:`CpuPeakMemory`, the process's peak resident set (Linux ``VmHWM``), reset to the
  current resident set by writing ``5`` to ``/proc/self/clear_refs``, all in the same process. For the
  resident set to follow the live tensors, glibc is told (``mallopt``) to serve every block over 64 KiB with
  its own ``mmap`` (returned to the OS when freed) while a measurement runs, and free heap pages are released
  (``malloc_trim``) before the baseline is read. It is an OS-level measure, near but not equal to tensor bytes
  (it includes allocator and library overheads); compare variants measured the same way.
- Subprocesses: :func:`run_killable` runs a command with a time limit and kills its whole process group at the
  limit (pytest workers, compute-sanitizer's children), returning the output decoded.
- Results: :func:`write_results` writes ``bench/results/<name>_<UTC time>.json`` with the device, the software
  versions (:func:`fastpals.env.collect`), the git commit and the date, when ``FASTPALS_BENCH_WRITE=1``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import datetime
import gc
import json
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
WRITE_ENV = "FASTPALS_BENCH_WRITE"

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MEASURE_MMAP_THRESHOLD = 64 * 1024
# after a measurement: the largest threshold glibc's dynamic rule would reach on 64-bit (32 MiB)
_RESTORE_MMAP_THRESHOLD = 32 * 1024 * 1024


def should_write() -> bool:
    """True when ``FASTPALS_BENCH_WRITE=1``: the suites then write their results under ``bench/results/``."""
    return os.environ.get(WRITE_ENV) == "1"


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA); nothing to do on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------------------------
# time
# ----------------------------------------------------------------------------------------------------------------


class StepTimer:
    """``StepTimer(fn, device)``: calling it calls ``fn()``, synchronises ``device`` and records the seconds.

    Give it to ``benchmark.pedantic``; :meth:`median` then reads the same calls pytest-benchmark measured,
    skipping the first ``warmup`` calls (pytest-benchmark's warm-up rounds).
    """

    def __init__(self, fn: Callable[[], Any], device: torch.device | str) -> None:
        self.fn = fn
        self.device = torch.device(device)
        self.seconds: list[float] = []

    def __call__(self) -> None:
        sync(self.device)
        start = time.perf_counter()
        self.fn()
        sync(self.device)
        self.seconds.append(time.perf_counter() - start)

    def measured(self, warmup: int) -> list[float]:
        """The recorded times after the first ``warmup`` calls (all of them when there are no more)."""
        return self.seconds[warmup:] or list(self.seconds)

    def median(self, warmup: int) -> float:
        times = self.measured(warmup)
        if not times:
            raise RuntimeError("StepTimer: no call was recorded")
        return statistics.median(times)


# ----------------------------------------------------------------------------------------------------------------
# peak memory
# ----------------------------------------------------------------------------------------------------------------


class CudaPeakMemory:
    """Peak of ``torch.cuda.max_memory_allocated`` over a block: ``with CudaPeakMemory(dev) as m: ...``, then
    ``m.peak_bytes`` (absolute: everything allocated at the peak, weights and optimizer state included) and
    ``m.start_bytes`` (allocated when the block began)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaPeakMemory needs a CUDA device, got {self.device}")
        self.start_bytes = 0
        self.peak_bytes = 0

    def __enter__(self) -> CudaPeakMemory:
        torch.cuda.synchronize(self.device)
        self.start_bytes = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize(self.device)
        self.peak_bytes = torch.cuda.max_memory_allocated(self.device)


def proc_status_kb(field: str) -> int:
    """A field of ``/proc/self/status`` in KiB (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def peak_after_warmup_kb(step: Callable[[], Any], runs: int = 2) -> dict[str, int]:
    """After one warm-up ``step()``: the resident set (KiB) ``runs`` more steps start from, and their peak
    (``VmHWM`` reset to ``VmRSS``); for a fresh subprocess per variant."""
    step()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    start = proc_status_kb("VmRSS")
    for _ in range(runs):
        step()
    return {"peak_kb": proc_status_kb("VmHWM"), "start_kb": start}


def _proc_status_bytes(field: str) -> int:
    return proc_status_kb(field) * 1024


def interleaved_times(
    steps: dict[str, Callable[[], Any]], rounds: int, sync: Callable[[], None] = lambda: None
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall-clock and process-CPU seconds of every step of each variant, run round robin after one warm-up step
    each (allocations, optimizer state, buffers); ``sync`` after each step (a CUDA device's queue)."""
    wall: dict[str, list[float]] = {k: [] for k in steps}
    cpu: dict[str, list[float]] = {k: [] for k in steps}
    for fn in steps.values():
        fn()
    sync()
    for _ in range(rounds):
        for name, fn in steps.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return wall, cpu


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt  # noqa: B018 - glibc only
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def cpu_peak_supported() -> tuple[bool, str]:
    """Can :class:`CpuPeakMemory` measure here? Needs Linux's ``/proc/self/clear_refs`` and ``VmHWM``, and
    glibc (``mallopt``, ``malloc_trim``)."""
    if not os.path.exists("/proc/self/clear_refs"):
        return False, "no /proc/self/clear_refs (not Linux): the peak resident set cannot be reset"
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _proc_status_bytes("VmHWM")
    except (OSError, RuntimeError) as exc:
        return False, f"cannot reset or read the peak resident set: {exc}"
    if _libc() is None:
        return False, "not glibc (mallopt/malloc_trim missing): the resident set would not follow the tensors"
    return True, "VmHWM reset through /proc/self/clear_refs, glibc mmap threshold 64 KiB while measuring"


def cpu_rss_bytes(release: bool = True) -> int:
    """The current resident set of this process (``VmRSS``); ``release=True`` first runs the garbage collector
    and returns glibc's free heap pages to the OS, so that the number counts live memory."""
    if release:
        gc.collect()
        libc = _libc()
        if libc is not None:
            libc.malloc_trim(0)
    return _proc_status_bytes("VmRSS")


class CpuPeakMemory:
    """Peak resident set of this process over a block, measured in this process (Linux + glibc).

    ``with CpuPeakMemory() as m: ...``, then ``m.peak_bytes`` (the process's peak resident set during the block),
    ``m.start_bytes`` (the resident set at its start, after releasing free heap pages). Subtract a baseline read
    with :func:`cpu_rss_bytes` before the model existed to get the training's own peak.
    """

    def __init__(self) -> None:
        ok, reason = cpu_peak_supported()
        if not ok:
            raise RuntimeError(f"CPU peak memory cannot be measured here: {reason}")
        self.libc = _libc()
        self.start_bytes = 0
        self.peak_bytes = 0

    def __enter__(self) -> CpuPeakMemory:
        self.libc.mallopt(_M_MMAP_THRESHOLD, _MEASURE_MMAP_THRESHOLD)
        self.libc.mallopt(_M_TRIM_THRESHOLD, _MEASURE_MMAP_THRESHOLD)
        self.start_bytes = cpu_rss_bytes(release=True)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak_bytes = _proc_status_bytes("VmHWM")
        self.libc.mallopt(_M_MMAP_THRESHOLD, _RESTORE_MMAP_THRESHOLD)
        self.libc.mallopt(_M_TRIM_THRESHOLD, 2 * _RESTORE_MMAP_THRESHOLD)


@dataclasses.dataclass
class Finished:
    """What :func:`run_killable` returns: exit status (124 when killed at the limit), the output as text."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool


def run_killable(
    cmd: list[str], timeout_s: float, cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None
) -> Finished:
    """Run ``cmd`` in its own process group; at ``timeout_s`` kill the whole group (so that no grandchild keeps
    the pipes open) and return what it printed so far, decoded."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=max(timeout_s, 0.0))
        timed_out = False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
    return Finished(
        124 if timed_out else proc.returncode,
        out.decode(errors="replace"),
        err.decode(errors="replace"),
        timed_out,
    )


# ----------------------------------------------------------------------------------------------------------------
# results files
# ----------------------------------------------------------------------------------------------------------------


def git_commit() -> str:
    """The checked-out commit (with ``-dirty`` when tracked files differ), or ``unknown``."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=HERE,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def describe_device(env: dict[str, Any]) -> str:
    """One line naming the machine, from :func:`fastpals.env.collect`'s ``device``."""
    dev = env["device"]
    if dev["type"] == "cuda":
        return f"{dev['name']} (sm_{dev['capability'].replace('.', '')}, {dev['total_memory_bytes'] / 2**30:.1f} GiB)"
    return f"CPU {dev['name']}, {dev['cores']} cores, {dev['torch_threads']} torch threads"


def results_header(name: str) -> dict[str, Any]:
    """The fields every results file starts with: name, date (UTC), commit, device, environment."""
    from fastpals.env import collect

    env = collect()
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "name": name,
        "date": now.isoformat(timespec="seconds"),
        "commit": git_commit(),
        "device": describe_device(env),
        "device_type": env["device"]["type"],
        "env": env,
    }


def write_results(
    name: str, payload: dict[str, Any], results_dir: Path | str | None = None, path: Path | None = None
) -> Path:
    """Write ``<results_dir>/<name>_<UTC time>.json`` = :func:`results_header` + ``payload``; return the path.
    ``path``: rewrite that file instead (a run that records its results as they come).

    ``name`` must be a plain file-name stem (letters, digits, ``_``, ``-``, ``.``).
    """
    if not name or any(not (c.isalnum() or c in "_-.") for c in name):
        raise ValueError(f"name must be a plain file-name stem, got {name!r}")
    doc = {**results_header(name), **payload}
    out_dir = Path(results_dir) if results_dir is not None else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = path or out_dir / f"{name}_{stamp}.json"
    partial = path.with_name(path.name + ".partial")  # then renamed: a killed writer leaves no half file
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.replace(partial, path)
    return path


@contextlib.contextmanager
def env_var(name: str, value: str | None) -> Iterator[None]:
    """Set (``None``: unset) an environment variable for the duration of a block."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
