"""Small inputs shared by the model tests."""

import torch
from device import DEVICE


def padded_batch(b: int = 5, n: int = 9, seed: int = 0, second_segment: int | None = None):
    """``(input_ids, attention_mask, token_type_ids)``, ``[b, n]``: row ``i`` has ``i`` padding tokens at the end;
    token types are 1 from column ``second_segment`` on (None: all 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (b, n), generator=g)
    mask = torch.ones(b, n, dtype=torch.long)
    for i in range(b):
        mask[i, n - i :] = 0
    types = torch.zeros_like(ids)
    if second_segment is not None:
        types[:, second_segment:] = 1
    return ids, mask, types


def max_err(a: torch.Tensor, ref64: torch.Tensor) -> float:
    """The largest error of ``a`` against the float64 ``ref64``, relative to ``ref64``'s largest value."""
    return float((a.double() - ref64).abs().max() / ref64.abs().max().clamp_min(1e-300))


def make_buf(t: int, p: int, dtype: torch.dtype, seed: int, row_pad: int = 0) -> torch.Tensor:
    """A ``[t, p]`` surgery buffer on DEVICE with rows of different scales; ``row_pad > 0``: rows strided by
    ``p + row_pad``."""
    gen = torch.Generator().manual_seed(seed)
    full = (torch.randn(t, p + row_pad, generator=gen) * torch.rand(t, 1, generator=gen) * 3).to(
        DEVICE, dtype
    )
    return full[:, :p]
