"""Every Triton kernel compiles for sm_75 (T4), sm_80 (A100) and sm_90 (H100) at the launch configurations the host
wrappers choose, with Triton's own specialisations, and fits each GPU: shared memory within the per-block limit,
no register spills in 16-bit kernels on sm_80/sm_90 (a stated bound for fp32), tensor-core instructions in the
16-bit dots, at most twice the fp32 products its row pairs need in the small-T Gram. Runs on CPU:
``fastpals_kernels.aot`` compiles each launch against a fake driver and reads ``ptxas -v``. Compiled kernels and
ptxas reports are cached in ``<venv>/fastpals-aot-cache`` between runs."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.aot

TARGETS = (75, 80, 90)
LIMIT_KIB = {75: 64, 80: 163, 90: 227}
#: spill bound (bytes stored per thread) of fp32 kernels on sm_80/sm_90: fp32 dots run on CUDA cores (IEEE, no
#: TF32) and their tiles take twice the registers of 16-bit ones. Measured with Triton 3.9: at most 12 B on sm_80
#: and 172 B on sm_90 (attention forward and dK/dV, packed rows, head dim 34/46).
FP32_SPILL_BOUND = 256
#: kernels whose launches must all be compiled (every Triton kernel of the package)
ALL_KERNELS = {
    "_grouped_mm_kernel",
    "_grouped_wgrad_kernel",
    "_pal_attn_fwd_kernel",
    "_pal_attn_bwd_delta_kernel",
    "_pal_attn_bwd_dkdv_kernel",
    "_pal_attn_bwd_dq_kernel",
    "_pal_attn_dropout_mask_kernel",
    "_gram_partial_kernel",
    "_gram_pairs_kernel",
    "_combine_kernel",
    "_stream_gram_kernel",
    "_stream_combine_kernel",
    "_dropout_add_ln_fwd_kernel",
    "_dropout_add_ln_bwd_kernel",
}
#: on sm_75 the dispatch sends only these to Triton (memory-bound; see fastpals_kernels.dispatch.decide)
SM75_DISPATCHED = {"_gram_partial_kernel", "_gram_pairs_kernel", "_combine_kernel"}


def _nvidia_backend_missing() -> str | None:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        get_ptxas(80)
    except Exception as exc:  # Triton without its NVIDIA backend or ptxas
        return f"Triton's NVIDIA backend or its ptxas is unavailable: {exc}"
    return None


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    missing = _nvidia_backend_missing()
    if missing:
        pytest.skip(missing)
    out_dir = tmp_path_factory.mktemp("aot")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_CACHE_DIR", os.path.join(sys.prefix, "fastpals-aot-cache"))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

    def run(cap: int) -> dict:
        path = out_dir / f"aot_{cap}.json"
        proc = subprocess.run(
            [sys.executable, "-m", "fastpals_kernels.aot", "--cap", str(cap), "--out", str(path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=1200,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        with open(path) as f:
            result = json.load(f)
        result["table"] = proc.stdout
        return result

    with ThreadPoolExecutor(max_workers=2) as pool:  # two compiler processes: CI has two cores
        return dict(zip(TARGETS, pool.map(run, TARGETS)))


def _half(record: dict) -> bool:
    return "float16" in record["dtype"]  # float16 or bfloat16 operands


@pytest.mark.parametrize("cap", TARGETS)
def test_every_kernel_compiles_for_every_case(results, cap):
    res = results[cap]
    assert res["errors"] == [], res["errors"][:3]
    assert {r["kernel"] for r in res["records"]} == ALL_KERNELS
    for r in res["records"]:
        assert r["ptxas_rc"] == 0 and r["regs"] is not None, r
    # the cases cover padded and packed batches, with and without dropout, and every dtype of the target
    flags = [r["constexprs"] for r in res["records"] if r["kernel"] == "_pal_attn_bwd_dkdv_kernel"]
    assert {(f["IS_VARLEN"], f["HAS_DROPOUT"]) for f in flags} == {(a, b) for a in (0, 1) for b in (0, 1)}
    dtypes = {r["dtype"] for r in res["records"] if r["kernel"] == "_grouped_mm_kernel"}
    assert dtypes == ({"float32", "float16"} if cap == 75 else {"float32", "float16", "bfloat16"})


@pytest.mark.parametrize("cap", TARGETS)
def test_shared_memory_fits_the_block_limit(results, cap):
    for r in results[cap]["records"]:
        assert r["shared"] <= LIMIT_KIB[cap] * 1024, (r["kernel"], r["constexprs"], r["shared"])


@pytest.mark.parametrize("cap", [80, 90])
def test_no_spills_in_16bit_kernels(results, cap):
    spilling = [
        (r["kernel"], r["dtype"], r["constexprs"], r["spill_stores"])
        for r in results[cap]["records"]
        if _half(r) and r["spill_stores"] > 0
    ]
    assert spilling == []


@pytest.mark.parametrize("cap", [80, 90])
def test_fp32_spills_stay_within_the_stated_bound(results, cap):
    worst = max(r["spill_stores"] for r in results[cap]["records"] if not _half(r))
    assert worst <= FP32_SPILL_BOUND


def test_sm75_kernels_the_dispatch_uses_do_not_spill(results):
    """On a T4 the PAL ops go to cuBLAS + SDPA (Triton emits no mma there); Gram and combine stay on Triton."""
    for r in results[75]["records"]:
        if r["kernel"] in SM75_DISPATCHED:
            assert r["spill_stores"] == 0, (r["kernel"], r["dtype"], r["spill_stores"])
    assert all(r["mma_sync"] == 0 and r["wgmma"] == 0 for r in results[75]["records"]), "Triton now emits mma"


@pytest.mark.parametrize("cap", [80, 90])
def test_16bit_dots_use_tensor_cores(results, cap):
    from fastpals_kernels.aot import DOT_KERNELS

    for r in results[cap]["records"]:
        if r["kernel"] in DOT_KERNELS and _half(r):
            assert r["mma_sync"] + r["wgmma"] > 0, (r["kernel"], r["dtype"], r["constexprs"])


#: the seed PAL shapes (d_s, heads) of issue #17: head dims 34, 17 and 46, widths 204 and 276
SEED_PAL_SHAPES = ((204, 6), (204, 12), (276, 6))
#: attention kernels with a loop to pipeline (the delta pass has none)
PIPELINED_ATTENTION = ("_pal_attn_fwd_kernel", "_pal_attn_bwd_dkdv_kernel", "_pal_attn_bwd_dq_kernel")


@pytest.mark.parametrize("cap", [80, 90])
@pytest.mark.parametrize("d_s, heads", SEED_PAL_SHAPES)
def test_16bit_pal_loads_are_vectorised_and_pipelined(results, cap, d_s, heads):
    """The fused PAL's zero-padded layout (fastpals_kernels.pal.pal_layout: heads of 40/24/48, ``s`` 208 or
    288 wide) makes its 16-bit loads 16-byte aligned: the attention forward and backward and the QKV and V^D
    forward GEMMs copy global -> shared with 16-byte ``cp.async`` (before the padding they had none)."""
    from fastpals_kernels.pal import pal_layout

    lay = pal_layout(d_s, heads)
    tag = f" d_s={d_s} H={heads} "
    half = [r for r in results[cap]["records"] if _half(r) and any(tag in c for c in r["cases"])]
    for name in PIPELINED_ATTENTION:
        variants = [r for r in half if r["kernel"] == name]
        assert variants, name
        for r in variants:
            assert r["cp_async_16"] > 0, (name, r["dtype"], r["constexprs"], r["cp_async"])

    def forward_gemms(n_out, k_red):
        """16-bit ``_grouped_mm_kernel`` variants launched as ``out[R, n_out] = a[R, k_red] @ W[t]ᵀ``."""
        return [
            r
            for r in half
            if r["kernel"] == "_grouped_mm_kernel"
            and any(
                (x["N_OUT"], x["K_RED"], x["stride_wk"]) == (n_out, k_red, 1)
                and x["K_W"] == k_red  # the padded weight spans the whole aligned width
                for x in r["launches"]
            )
        ]

    qkv = forward_gemms(lay.qkv_width, lay.s_width)
    dec = [r for d in (768, 384) for r in forward_gemms(d, lay.ctx_width) if r["constexprs"]["GELU"]]
    assert qkv and dec
    for r in qkv + dec:
        assert r["cp_async_16"] > 0, (r["dtype"], r["constexprs"], r["launches"][:2], r["cp_async"])
    assert {r["dtype"] for r in qkv} == {"float16", "bfloat16"}


@pytest.mark.parametrize("cap", [80, 90])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_small_gram_reads_each_element_once_and_does_only_the_pair_products(results, cap, dtype):
    """At T = 3 each column of the buffer is T loaded elements and needs T (T + 1) / 2 products (the upper
    triangle). Counted in the code of one pass of the Gram kernel's loop (one thread's instructions, times its
    threads, per ``BLOCK_P`` columns): it loads T elements per column (PTX global loads), and its fp32 products
    (PTX ``fma`` + ``mul``, and SASS ``FFMA`` + ``FMUL``) per loaded element are at most twice
    T (T + 1) / 2 / T."""
    t, size = 3, {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    name = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
    grams = [
        r
        for r in results[cap]["records"]
        if r["kernel"].startswith("_gram") and f"gram+combine {name} T={t}" in r["cases"]
    ]
    assert len(grams) == 1, [(r["kernel"], r["cases"]) for r in grams]
    r = grams[0]
    columns_per_thread = r["constexprs"]["BLOCK_P"] / (32 * r["num_warps"])
    loaded = r["loaded_bytes"] / size
    products = r["fma"] + r["mul"]
    assert products / loaded <= 2 * (t * (t + 1) / 2) / t, (r["kernel"], products, loaded, r["constexprs"])
    sass = (r.get("sass_ffma"), r.get("sass_fmul"))  # counted for fastpals_kernels.aot.SASS_KERNELS
    assert None not in sass and sum(sass) == products, (r["kernel"], sass, products)
    assert loaded / columns_per_thread == t, (r["kernel"], r["loaded_bytes"], r["constexprs"])
    assert products / columns_per_thread >= t * (t + 1) / 2, (r["kernel"], r["fma"], r["mul"])  # counted them
