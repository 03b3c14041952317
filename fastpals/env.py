"""What fastpals will use on this machine: ``python -m fastpals.env`` (or ``fastpals env``).

Versions, the device, which backends can run and why not, and each op's backend (``--capability 7.5``: another
GPU's). Nothing is built, downloaded, or slow to import (DeepSpeed)."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from typing import Any

import torch

from fastpals._version import __version__
from fastpals_kernels import backends

__all__ = ["PACKAGES", "collect", "format_report", "main"]

#: distributions whose versions are reported (pip names); ``None`` when not installed
PACKAGES = ("torch", "triton", "deepspeed", "transformers", "tokenizers", "safetensors")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    """The CPU's marketing name (``model name`` in /proc/cpuinfo on Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.lower().startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine() or "unknown CPU"


def _device_info() -> dict[str, Any]:
    """The CUDA device (name, capability, memory, count), else the CPU (name, cores, torch threads)."""
    if not torch.cuda.is_available():
        return {
            "type": "cpu",
            "name": _cpu_model(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        }
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {
        "type": "cuda",
        "index": index,
        "count": torch.cuda.device_count(),
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "total_memory_bytes": int(props.total_memory),
        "multiprocessors": int(props.multi_processor_count),
    }


def _status(available: bool, reason: str) -> dict[str, Any]:
    return {"available": bool(available), "reason": reason}


def _flash_attn() -> dict[str, Any]:
    if importlib.util.find_spec("flash_attn") is None:
        return _status(False, "flash_attn is not installed")
    version = _version("flash-attn") or _version("flash_attn") or "unknown version"
    if not torch.cuda.is_available():
        return _status(False, f"flash_attn {version} is installed but there is no CUDA device")
    try:
        importlib.import_module("flash_attn")
    except Exception as exc:  # a wheel built for another torch/CUDA fails here with various errors
        return _status(False, f"flash_attn {version} fails to import: {type(exc).__name__}: {exc}")
    return _status(True, f"flash_attn {version} on CUDA")


def _apex_op(module: str, name: str, extension: str) -> dict[str, Any]:
    """An apex fused op: apex installed, its compiled extension present (apex installs without them unless
    built with ``--cpp_ext --cuda_ext``), a CUDA device, and the class importable."""
    if importlib.util.find_spec("apex") is None:
        return _status(False, "apex is not installed")
    if importlib.util.find_spec(extension) is None:
        return _status(False, f"apex is installed without its compiled extension {extension}")
    if not torch.cuda.is_available():
        return _status(False, f"apex {extension} is built but there is no CUDA device")
    try:
        getattr(importlib.import_module(module), name)
    except Exception as exc:
        return _status(False, f"{module}.{name} fails to import: {type(exc).__name__}: {exc}")
    return _status(True, f"{module}.{name}")


def _kernel_selection(triton: dict[str, Any]) -> dict[str, Any]:
    """What ``$FASTPALS_KERNELS`` makes the PAL and surgery ops run (the rule of ``fastpals_kernels.use_triton``)."""
    raw = os.environ.get(backends.KERNELS_ENV)
    mode = (raw or "auto").strip().lower() or "auto"
    ok, reason = triton["available"], triton["reason"]
    if mode == "reference":
        selects = "the PyTorch reference ops everywhere"
    elif mode == "auto" and ok and torch.cuda.is_available():
        selects = "the Triton kernels for CUDA tensors, the PyTorch reference ops for CPU tensors"
    elif mode == "auto" and ok:
        selects = (
            "the PyTorch reference ops (auto runs the Triton kernels on CUDA tensors only; no CUDA device)"
        )
    elif mode == "auto":
        selects = f"the PyTorch reference ops (Triton kernels unavailable: {reason})"
    elif mode == "triton" and ok:
        selects = f"the Triton kernels ({reason}); ops on other devices raise an error"
    elif mode == "triton":
        selects = f"an error at the first fused op: the Triton kernels cannot run ({reason})"
    else:
        selects = f"an error: {mode!r} is not one of auto, triton, reference"
    return {"env": backends.KERNELS_ENV, "value": raw, "mode": mode, "selects": selects}


_DTYPE_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _parse_capability(text: str) -> tuple[int, int] | None:
    """``"8.0"``/``"80"``/``"sm_80"`` -> (8, 0); ``"cpu"`` -> None."""
    t = text.strip().lower().removeprefix("sm_")
    if t == "cpu":
        return None
    major, _, minor = t.partition(".") if "." in t else (t[:-1], "", t[-1:])
    if not (major.isdigit() and minor.isdigit()):
        raise ValueError(f"capability must look like 8.0, 80, sm_80 or cpu, got {text!r}")
    return int(major), int(minor)


def _dispatch(capability: tuple[int, int] | None) -> dict[str, Any]:
    """The backend and reason :func:`fastpals_kernels.backends.decide` gives every op, per dtype, on a device of
    ``capability`` (None = CPU), with flash-attn as installed here."""
    flash = backends.flash_attn_installed()
    return {
        "capability": None if capability is None else f"{capability[0]}.{capability[1]}",
        "ops": {
            op: {
                name: backends.decide(op, capability, dtype, flash)._asdict()
                for name, dtype in _DTYPE_NAMES.items()
            }
            for op in backends.OPS
        },
    }


def collect(capability: tuple[int, int] | None | str = "device") -> dict[str, Any]:
    """Everything :func:`main` prints, as a JSON-serialisable dict: versions, ``device``, ``backends``
    (``{name: {"available", "reason"}}``), ``kernels`` (what ``$FASTPALS_KERNELS`` selects) and ``dispatch``
    (each op's backend per dtype, for this device or ``capability``: ``(major, minor)``, or None for a CPU)."""
    found = {
        "triton_kernels": _status(*backends.available()),
        "flash_attn": _flash_attn(),
        "apex_fused_layer_norm": _apex_op("apex.normalization", "FusedLayerNorm", "fused_layer_norm_cuda"),
        "apex_fused_adam": _apex_op("apex.optimizers", "FusedAdam", "amp_C"),
    }
    if capability == "device":
        capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    return {
        "fastpals": __version__,
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "versions": {name: _version(name) for name in PACKAGES},
        "torch_cuda": torch.version.cuda,
        "device": _device_info(),
        "backends": found,
        "kernels": _kernel_selection(found["triton_kernels"]),
        "dispatch": _dispatch(capability),
    }


_BACKEND_LABELS = {
    "triton_kernels": "Triton kernels",
    "flash_attn": "flash-attn",
    "apex_fused_layer_norm": "apex FusedLayerNorm",
    "apex_fused_adam": "apex FusedAdam",
}


def format_report(info: dict[str, Any]) -> str:
    """The text :func:`main` prints for a :func:`collect` dict, one ``name: value`` line per item."""
    lines = [f"fastpals: {info['fastpals']}", f"python: {info['python']} ({info['python_executable']})"]
    for name, version in info["versions"].items():
        text = version or "not installed"
        if name == "torch" and version:
            text += f" (CUDA {info['torch_cuda']})" if info["torch_cuda"] else " (CPU build)"
        lines.append(f"{name}: {text}")
    dev = info["device"]
    if dev["type"] == "cuda":
        gib = dev["total_memory_bytes"] / 2**30
        lines.append(
            f"device: cuda:{dev['index']} {dev['name']} (compute capability {dev['capability']}, "
            f"{gib:.1f} GiB, {dev['count']} device(s))"
        )
    else:
        lines.append(
            f"device: cpu {dev['name']} ({dev['cores']} cores, torch threads {dev['torch_threads']})"
        )
    lines.append("backends:")
    for key, status in info["backends"].items():
        flag = "yes" if status["available"] else "no"
        lines.append(f"  {_BACKEND_LABELS.get(key, key)}: {flag} ({status['reason']})")
    k = info["kernels"]
    value = k["value"] if k["value"] is not None else "unset = auto"
    lines.append(f"{k['env']}: {value} -> {k['selects']}")
    disp = info["dispatch"]
    where = "cpu" if disp["capability"] is None else f"sm_{disp['capability'].replace('.', '')}"
    lines.append(f"dispatch (auto, {where}):")
    for op, per_dtype in disp["ops"].items():
        for dtype, d in per_dtype.items():
            lines.append(f"  {op} {dtype}: {d['backend']} ({d['reason']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the report (``--json``: the :func:`collect` dict as JSON). ``argv`` excludes the program name;
    ``None`` means no options (so ``fastpals env`` can call ``main()`` without the CLI's own arguments)."""
    parser = argparse.ArgumentParser(prog="fastpals env", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the collected information as JSON")
    parser.add_argument(
        "--capability",
        help="show the dispatch for another device: a compute capability (7.5, 8.0, 9.0) or cpu",
    )
    args = parser.parse_args([] if argv is None else argv)
    try:
        capability = "device" if args.capability is None else _parse_capability(args.capability)
    except ValueError as exc:
        parser.error(str(exc))
    info = collect(capability)
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
