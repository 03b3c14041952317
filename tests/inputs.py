"""Small inputs shared by the model tests."""

import torch


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
