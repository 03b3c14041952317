"""Ahead-of-time compilation of every fastpals Triton kernel for a GPU target, on a machine without a GPU.

``python -m fastpals_kernels.aot --cap 80 --out aot_80.json`` runs the real host wrappers on CPU tensors with
Triton's driver replaced by one whose target is ``GPUTarget("cuda", CAP, 32)``: every launch becomes a
compile-only warm-up at the launch configuration chosen for that target, and ``ptxas -v`` reports each
variant's registers, spills and shared memory. Runs in its own process (FASTPALS_AOT=1 before Triton loads).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

import fastpals_kernels as kernels
from fastpals_kernels.combine import combine_triton
from fastpals_kernels.common import build_task_row_plan
from fastpals_kernels.dropout_layer_norm import (
    dropout_add_layer_norm_backward_triton,
    dropout_add_layer_norm_triton,
)
from fastpals_kernels.gram import gram_triton
from fastpals_kernels.stream_linear import stream_linear_combine_triton, stream_linear_gram_triton

#: per-block shared memory (bytes) of each target
SMEM_LIMIT = {75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
#: dtypes each target runs (sm_75 has no bf16 tensor cores and the dispatch never sends bf16 there)
TARGET_DTYPES = {75: ("fp32", "fp16"), 80: ("fp32", "fp16", "bf16"), 90: ("fp32", "fp16", "bf16")}
#: (d, d_s, heads): BERT-base and MiniLM widths with the seed PAL widths and head counts
PAL_SHAPES = ((768, 204, 6), (768, 204, 12), (768, 276, 6), (768, 276, 12), (384, 204, 6), (384, 276, 12))
#: fp32 arithmetic in PTX: fused multiply-adds, multiplies, adds (any rounding/ftz modifiers)
_FMA_F32 = re.compile(r"\bfma\.rn(?:\.ftz)?\.f32\b")
_MUL_F32 = re.compile(r"\bmul(?:\.rn)?(?:\.ftz)?\.f32\b")
_ADD_F32 = re.compile(r"\badd(?:\.rn)?(?:\.ftz)?\.f32\b")
#: a global load's vector width and bits per lane (``ld.global.v4.b32``, ``ld.global.nc.b16``, ...)
_LD_GLOBAL = re.compile(r"\bld\.global(?:\.[a-z_0-9:]+)*?(?:\.v(\d))?\.[bfsu](\d+)\b")
#: bytes of an asynchronous global -> shared copy (``cp.async.cg.shared.global [a], [b], 16``)
_CP_ASYNC_BYTES = re.compile(r"cp\.async\.c[ag]\.shared\.global[^;]*?,\s*(0x10|16|8|4)\s*[,;]")


def arithmetic_counts(ptx: str) -> dict[str, int]:
    """Static counts in one kernel's PTX (one thread's instructions, a loop body counted once): fp32 ``fma``,
    ``mul`` and ``add`` instructions, and ``loaded_bytes`` read by its global loads and ``cp.async`` copies.
    """
    loaded = sum(int(vec or 1) * int(bits) // 8 for vec, bits in _LD_GLOBAL.findall(ptx))
    loaded += sum(int(n, 0) for n in _CP_ASYNC_BYTES.findall(ptx))
    return {
        "fma": len(_FMA_F32.findall(ptx)),
        "mul": len(_MUL_F32.findall(ptx)),
        "add": len(_ADD_F32.findall(ptx)),
        "loaded_bytes": loaded,
    }


#: kernels whose SASS arithmetic is counted too (disassembly costs about half a second per variant)
SASS_KERNELS = ("_gram_pairs_kernel",)
#: distinct integer-argument sets kept per compiled variant
MAX_LAUNCHES = 64
#: kernels whose dots run on 16-bit operands for 16-bit inputs (gram up-casts to fp32 on purpose)
DOT_KERNELS = (
    "_grouped_mm_kernel",
    "_grouped_wgrad_kernel",
    "_pal_attn_fwd_kernel",
    "_pal_attn_bwd_dkdv_kernel",
    "_pal_attn_bwd_dq_kernel",
    "_stream_gram_kernel",
    "_stream_combine_kernel",
)


def _install_fake_driver(cap: int) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class CompileOnlyDriver:
        """Just enough of Triton's driver for a compile-only launch (warm-up) on CPU tensors."""

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", cap, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

    driver.set_active(CompileOnlyDriver())


def _ptxas_report(ptx: str, cap: int, sass: bool = False) -> dict[str, Any]:
    """``ptxas -v``'s registers, spills and stack of one kernel's PTX; with ``sass``, also its SASS's fp32
    ``FFMA``/``FMUL``/``FADD`` counts (``cuobjdump``, about half a second per kernel)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    arch = sm_arch_from_capability(cap)
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        ptxas = get_ptxas(cap).path
        cmd = [ptxas, "-v", f"--gpu-name={arch}", src, "-o", src + ".o"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        cuobjdump = os.path.join(os.path.dirname(ptxas), "cuobjdump")
        listing = None
        if sass and proc.returncode == 0 and os.path.exists(cuobjdump):
            listing = subprocess.run([cuobjdump, "-sass", src + ".o"], capture_output=True, text=True).stdout
    log = proc.stderr
    out: dict[str, Any] = {"ptxas_rc": proc.returncode}
    if listing is not None:  # fp32 arithmetic in the SASS, any modifiers, predicated or not
        for op in ("FFMA", "FMUL", "FADD"):
            out[f"sass_{op.lower()}"] = len(re.findall(rf"\s{op}(?:\.[A-Z0-9_.]+)?\s", listing))
    m = re.search(r"Used (\d+) registers", log)
    out["regs"] = int(m.group(1)) if m else None
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    out["stack"], out["spill_stores"], out["spill_loads"] = map(int, m.groups()) if m else (0, 0, 0)
    return out


class Recorder:
    """Wraps ``JITFunction.run``: each launch compiles (warm-up) and each new variant is measured once."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.records: dict[str, dict[str, Any]] = {}
        self.case = ""

    def ptxas(self, kernel_hash: str, ptx: str, sass: bool = False) -> dict[str, Any]:
        """:func:`_ptxas_report`, cached as JSON beside Triton's own cache (keyed on the kernel's hash)."""
        cache = os.environ.get("TRITON_CACHE_DIR")
        path = os.path.join(cache, f"fastpals-ptxas-{self.cap}-{kernel_hash}.json") if cache else None
        if path and os.path.exists(path):
            with open(path) as f:
                return json.load(f)
        report = _ptxas_report(ptx, self.cap, sass)
        if path:
            os.makedirs(cache, exist_ok=True)
            with open(path, "w") as f:
                json.dump(report, f)
        return report

    def install(self) -> None:
        from triton.runtime import jit

        original = jit.JITFunction.run
        recorder = self

        def run(fn: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            kernel = original(fn, *args, grid=grid, warmup=True, **kwargs)
            ints = {
                n: a for n, a in zip(fn.arg_names, args) if isinstance(a, int) and not isinstance(a, bool)
            }
            recorder.record(fn.fn.__name__, kernel, args, kwargs, ints)
            return kernel

        jit.JITFunction.run = run

    def record(self, name: str, kernel: Any, args: tuple, kwargs: dict, ints: dict | None = None) -> None:
        """One launch: a new variant is measured; every variant keeps the case labels that launched it and
        (up to :data:`MAX_LAUNCHES`) the distinct integer arguments it was launched with (sizes, strides)."""
        key = f"{name}:{kernel.hash}"
        rec = self.records.get(key)
        if rec is None:
            ptx, ttgir = kernel.asm["ptx"], kernel.asm.get("ttgir", "")
            dtypes = {str(a.dtype).replace("torch.", "") for a in args if hasattr(a, "dtype")}
            dtypes = sorted(d for d in dtypes if d.startswith(("float", "bfloat")))
            if "DT" in kwargs:  # operands read through address tables: their dtype is the constexpr DT
                dtypes = [{"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[str(kwargs["DT"])]]
            rec = {
                "kernel": name,
                "dtype": "/".join(dtypes),
                "constexprs": {
                    k: v
                    for k, v in kwargs.items()
                    if isinstance(v, (bool, int, float, str)) and k[0].isupper()
                },
                "num_warps": kernel.metadata.num_warps,
                "num_stages": kernel.metadata.num_stages,
                "shared": int(kernel.metadata.shared),
                "smem_limit": SMEM_LIMIT[self.cap],
                "mma_sync": ptx.count("mma.sync"),
                "wgmma": ptx.count("wgmma.mma_async"),
                "mma_layout": sorted(set(re.findall(r"nvidia_mma<\{versionMajor = (\d)", ttgir))),
                "cp_async": ptx.count("cp.async"),
                "cp_async_16": sum(n in ("0x10", "16") for n in _CP_ASYNC_BYTES.findall(ptx)),
                **arithmetic_counts(ptx),
                "cases": [],
                "launches": [],
            }
            rec.update(self.ptxas(kernel.hash, ptx, sass=name in SASS_KERNELS))
            self.records[key] = rec
        if self.case not in rec["cases"]:
            rec["cases"].append(self.case)
        if ints is not None and ints not in rec["launches"] and len(rec["launches"]) < MAX_LAUNCHES:
            rec["launches"].append(ints)


def pal_weight_shapes(t: int, d: int, d_s: int) -> list[tuple[int, ...]]:
    """The shapes of the PAL op's six weights for ``t`` tasks, in argument order: ``enc_weight [t, d_s, d]``,
    its bias, ``qkv_weight [t, 3 d_s, d_s]``, its bias, ``dec_weight [t, d, d_s]``, its bias."""
    return [(t, d_s, d), (t, d_s), (t, 3 * d_s, d_s), (t, 3 * d_s), (t, d, d_s), (t, d)]


def _pal_case(dtype: Any, d: int, d_s: int, heads: int, packed: bool, dropout: float) -> None:
    batch, length, tasks = 8, 128, 3
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=g)
    lengths[0] = length
    mask = torch.arange(length)[None, :] < lengths[:, None]
    task_ids = torch.arange(batch) % tasks

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype).requires_grad_()

    weights = [w(*shape) for shape in pal_weight_shapes(tasks, d, d_s)]
    h = torch.randn(batch, length, d, generator=g).to(dtype)
    if packed:
        rows = h[mask].requires_grad_()
        cu = torch.zeros(batch + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lengths, 0)
        res = rows.detach().clone().requires_grad_()
        y = kernels.pal_varlen(rows, cu, length, task_ids, *weights, heads, True, dropout, residual=res)
    else:
        h.requires_grad_()
        res = h.detach().clone().requires_grad_()
        y = kernels.pal(h, mask, task_ids, *weights, heads, True, dropout, residual=res)
    y.float().sum().backward()


def _grouped_case(dtype: Any, d_in: int, d_out: int, gelu: bool) -> None:
    x = torch.randn(8, 128, d_in).to(dtype).requires_grad_()
    w = (torch.randn(3, d_out, d_in) * 0.02).to(dtype).requires_grad_()
    b = torch.zeros(3, d_out).to(dtype).requires_grad_()
    y = kernels.grouped_linear(x, torch.arange(8) % 3, w, b, "gelu" if gelu else None)
    y.float().sum().backward()


def _buffer_case(dtype: Any, tasks: int) -> None:
    buf = torch.zeros(tasks, 1 << 20, dtype=dtype)
    gram_triton(buf)
    for out_dtype in {torch.float32, dtype}:
        combine_triton(buf, torch.ones(tasks), torch.empty(1 << 20, dtype=out_dtype))
    combine_triton(buf, torch.ones(tasks), buf[0])


def _stream_case(dtype: Any, tasks: int) -> None:
    plan = build_task_row_plan(torch.arange(8) % tasks, tasks, 8 * 128, seq_len=128)
    dy = [torch.zeros(8 * 128, m, dtype=dtype) for m in (768, 3072)]
    x = [torch.zeros(8 * 128, 768, dtype=dtype)] * 2
    args = (dy, x, [plan.row_index] * 2, [plan.task_row_offsets] * 2, [0, 1], [True, False])
    stream_linear_gram_triton(*args, tasks)
    stream_linear_combine_triton(*args, torch.ones(tasks))


def _dropout_layer_norm_case(dtype: Any, residual_dtype: Any, d: int, p: float, extra: bool) -> None:
    """BERT's sublayer output over 8 x 128 rows: forward and backward kernels (an fp32 residual: autocast)."""
    x = torch.zeros(8 * 128, d, dtype=dtype)
    residual = torch.zeros(8 * 128, d, dtype=residual_dtype)
    more = torch.zeros_like(residual) if extra else None
    w, b = torch.ones(d), torch.zeros(d)
    out_dtype = torch.promote_types(dtype, residual_dtype)
    y, mean, rstd = dropout_add_layer_norm_triton(x, residual, more, w, b, 1e-12, p, 1234, out_dtype)
    dropout_add_layer_norm_backward_triton(y, x, residual, more, w, mean, rstd, p, 1234)


def _dropout_mask_case() -> None:
    from fastpals_kernels.pal_attention import pal_attention_dropout_mask

    pal_attention_dropout_mask(8, 12, 128, 0.1, seed=1234, device="cpu")


def cases(cap: int, quick: bool = False) -> list[tuple[str, Any, tuple]]:
    """Every compile case for target ``cap``: (label, function, arguments)."""
    dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    out: list[tuple[str, Any, tuple]] = [("dropout mask", _dropout_mask_case, ())]
    shapes = PAL_SHAPES[:3] if quick else PAL_SHAPES
    for name in TARGET_DTYPES[cap]:
        for d, d_s, heads in shapes:
            for packed in (False, True):
                for dropout in (0.0, 0.1):
                    form = "packed" if packed else "padded"
                    label = f"pal {name} d={d} d_s={d_s} H={heads} {form} p={dropout}"
                    out.append((label, _pal_case, (dt[name], d, d_s, heads, packed, dropout)))
        out.append((f"grouped_linear {name} 768->3072 gelu", _grouped_case, (dt[name], 768, 3072, True)))
        out.append((f"grouped_linear {name} 384->204", _grouped_case, (dt[name], 384, 204, False)))
        for tasks in (3, 8, 16, 32, 128):  # 8: the most row pairs; 128 = MAX_TASKS: 32 x 32 row blocks
            out.append((f"gram+combine {name} T={tasks}", _buffer_case, (dt[name], tasks)))
        # T_PAD 32: at T <= 16 the 16-bit combine kernel spills on sm_90, from T = 64 the Gram kernel
        out.append((f"stream_linear {name} T=32", _stream_case, (dt[name], 32)))
        # evaluation; training (under autocast an fp32 residual meets a 16-bit dense output); a PAL's output added
        for form, d, p, extra in (
            ("eval", 768, 0.0, False),
            ("train", 768, 0.1, False),
            ("extra", 384, 0.1, True),
        ):
            res = torch.float32 if form == "train" else dt[name]
            label = f"dropout_layer_norm {name} {form} d={d}"
            out.append((label, _dropout_layer_norm_case, (dt[name], res, d, p, extra)))
    return out


def compile_all(cap: int, quick: bool = False, only: str = "") -> dict[str, Any]:
    """Compile every case for ``cap`` (those whose label contains ``only``) in this process (which must not have
    loaded Triton's kernels yet)."""
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["FASTPALS_AOT"] = "1"
    _install_fake_driver(cap)
    recorder = Recorder(cap)
    recorder.install()
    errors, start = [], time.time()
    for label, fn, args in cases(cap, quick):
        if only not in label:
            continue
        recorder.case = label
        try:
            fn(*args)
        except Exception as exc:  # a compile failure (e.g. OutOfResources) is a result, reported per case
            errors.append({"case": label, "error": f"{type(exc).__name__}: {exc}"[:2000]})
    import triton

    return {
        "cap": cap,
        "triton": triton.__version__,
        "records": list(recorder.records.values()),
        "errors": errors,
        "wall_s": round(time.time() - start, 1),
    }


def summary_rows(result: dict[str, Any]) -> list[str]:
    """One Markdown table row per kernel and dtype: the worst registers, spills and shared memory over its
    variants, whether every 16-bit dot variant uses tensor cores, and the fewest 16-byte ``cp.async`` copies of
    any variant."""
    worst: dict[tuple[str, str], dict[str, Any]] = {}
    for r in result["records"]:
        w = worst.setdefault(
            (r["kernel"], r["dtype"]),
            {"regs": 0, "spill": 0, "smem": 0, "variants": 0, "mma": True, "cp16": r["cp_async_16"]},
        )
        w["regs"] = max(w["regs"], r["regs"] or 0)
        w["spill"] = max(w["spill"], r["spill_stores"])
        w["smem"] = max(w["smem"], r["shared"])
        w["variants"] += 1
        w["mma"] = w["mma"] and (r["mma_sync"] + r["wgmma"]) > 0
        w["cp16"] = min(w["cp16"], r["cp_async_16"])
    rows = []
    for (kernel, dtype), w in sorted(worst.items()):
        mma = "yes" if w["mma"] else "no"
        if kernel not in DOT_KERNELS or dtype == "float32":
            mma = "n/a" if not w["mma"] else "yes"
        rows.append(
            f"| sm_{result['cap']} | {kernel} | {dtype} | {w['variants']} | {w['regs']} | {w['spill']} | "
            f"{w['smem'] / 1024:.1f} / {result['records'][0]['smem_limit'] // 1024} | {mma} | {w['cp16']} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fastpals_kernels.aot", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--cap", type=int, required=True, choices=sorted(TARGET_DTYPES), help="75, 80 or 90")
    parser.add_argument("--out", required=True, help="JSON file for the per-variant records")
    parser.add_argument("--quick", action="store_true", help="only the first three PAL shapes")
    parser.add_argument("--only", default="", help="only the cases whose label contains this, e.g. 'gram'")
    args = parser.parse_args(argv)
    result = compile_all(args.cap, args.quick, args.only)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(
        "| target | kernel | dtype | variants | regs | spill B | smem KiB / limit | tensor cores "
        "| 16-B cp.async (fewest) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(summary_rows(result)))
    for e in result["errors"]:
        print("ERROR", e["case"], e["error"][:300])
    print(f"{len(result['records'])} variants, {len(result['errors'])} failing cases, {result['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
