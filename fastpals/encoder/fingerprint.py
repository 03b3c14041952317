"""The fingerprint of the encoder an adapter was trained with (``encoder.fingerprint`` in its config), checked
when it loads: a hash of every shared encoder parameter's name, shape and ``SAMPLES`` evenly spaced values,
rounded to bfloat16 so that fp32 and bf16 copies agree."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
from torch import nn

from fastpals.encoder.bert import task_specific_kind

#: values sampled per parameter tensor
SAMPLES = 1024
_SHARED_PREFIXES = ("embeddings.", "encoder.layer.")


class EncoderMismatchError(ValueError):
    """An adapter loads beside an encoder other than the one it was trained with (one line)."""


def parameter_digests(encoder: nn.Module) -> dict[str, str]:
    """Per shared parameter of ``encoder`` (names inside it), a digest of its name, shape and sampled values."""
    out = {}
    for name, p in encoder.named_parameters():
        if not name.startswith(_SHARED_PREFIXES) or task_specific_kind(name) is not None:
            continue
        flat = p.detach().reshape(-1)
        n = flat.numel()
        index = torch.linspace(0, max(n - 1, 0), min(n, SAMPLES), device=flat.device).round().long()
        values = flat.index_select(0, index).to(torch.bfloat16).view(torch.int16).cpu().numpy()
        out[name] = hashlib.sha256(f"{name}:{list(p.shape)};".encode() + values.tobytes()).hexdigest()
    return out


def encoder_fingerprint(encoder: nn.Module, exclude: Iterable[str] = ()) -> str:
    """16 hex digits of ``encoder``'s shared parameters but ``exclude`` (names inside the encoder)."""
    skip = set(exclude)
    digests = parameter_digests(encoder)
    text = ";".join(f"{name}={digests[name]}" for name in sorted(digests) if name not in skip)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_encoder_fingerprint(
    saved: str | None, encoder: nn.Module, exclude: Iterable[str], source: str, caller: str, force: bool
) -> None:
    """Raise ``EncoderMismatchError`` if ``saved`` (None: unchecked) is not ``encoder``'s, unless
    ``force``."""
    if saved is None or force or (own := encoder_fingerprint(encoder, exclude)) == saved:
        return
    if not all(bool(torch.isfinite(p).all()) for p in encoder.parameters()):  # broken, not another encoder
        raise EncoderMismatchError(
            f"{caller}: the encoder beside the adapter in {source} holds non-finite weights (NaN/inf): the "
            "model is broken; use another checkpoint"
        )
    raise EncoderMismatchError(
        f"{caller}: the adapter in {source} was trained with another encoder (fingerprint {saved}, this "
        f"encoder's {own}): load it beside the encoder it was saved with, or pass force=True (--force) to "
        "accept the mismatch"
    )
