"""The numeric helpers DeepEP's tests import from ``deep_ep.utils.math``."""
from typing import Tuple

import torch

_FP8_MAX = 448.0


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - 2<x, y> / (|x|^2 + |y|^2), in float64 (0 when x == y)."""
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    if float(denominator) == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denominator)


def safe_div(a, b) -> float:
    return 0.0 if b == 0 else a / b


def ceil_div(x: int, y: int) -> int:
    return (x + y - 1) // y


def align(x: int, y: int) -> int:
    return ceil_div(x, y) * y


def per_token_cast_to_fp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [m, n] (n a multiple of 128) -> (float8_e4m3fn [m, n], float32 scales
    [m, n / 128]): each 128-wide block scaled so its amax is 448."""
    m, n = x.shape
    assert n % 128 == 0
    blocks = x.float().view(m, n // 128, 128)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    q = (blocks * (_FP8_MAX / amax).unsqueeze(2)).to(torch.float8_e4m3fn).view(m, n)
    return q, (amax / _FP8_MAX).view(m, -1)


def per_token_cast_back(x_fp8: torch.Tensor, x_scales: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`per_token_cast_to_fp8` (bfloat16); int32 scales
    are packed UE8M0 bytes, four to a word."""
    if x_scales.dtype == torch.int:
        x_scales = x_scales.contiguous().view(torch.uint8).to(torch.int32) << 23
        x_scales = x_scales.view(torch.float)
    shape = x_fp8.shape
    blocks = x_fp8.float().reshape(*shape[:-1], -1, 128)
    out = blocks * x_scales.reshape(*shape[:-1], -1, 1).float()
    return out.reshape(shape).to(torch.bfloat16)


def inplace_unique(x: torch.Tensor, num_slots: int) -> None:
    """Each row of x [m, k] (values in [0, num_slots) or -1) becomes its
    distinct values in descending order, then -1s."""
    assert x.dim() == 2
    padded = x.masked_fill(x < 0, num_slots).long()
    present = torch.zeros((x.size(0), num_slots + 1), dtype=torch.bool, device=x.device)
    present.scatter_(1, padded, True)
    present = present[:, :num_slots]
    ids = torch.arange(num_slots, device=x.device).expand_as(present)
    values = torch.where(present, ids, -1).sort(dim=1, descending=True).values
    x.fill_(-1)
    width = min(num_slots, x.size(1))
    x[:, :width] = values[:, :width].to(x.dtype)


def create_grouped_scores(scores: torch.Tensor, group_idx: torch.Tensor,
                          num_groups: int) -> torch.Tensor:
    """scores [T, E] with the experts outside each token's groups
    (group_idx [T, g]) zeroed."""
    num_tokens, num_experts = scores.shape
    grouped = scores.view(num_tokens, num_groups, -1)
    mask = torch.zeros((num_tokens, num_groups), dtype=torch.bool, device=scores.device)
    mask = mask.scatter_(1, group_idx, True).unsqueeze(-1).expand_as(grouped)
    return (grouped * mask).view(num_tokens, num_experts)


def hash_tensor(t: torch.Tensor) -> int:
    """A checksum of t's bytes (equal tensors, equal hashes)."""
    raw = t.contiguous().view(torch.uint8).reshape(-1).long()
    weights = torch.arange(1, raw.numel() + 1, device=raw.device, dtype=torch.long) % 65521
    return int((raw * weights).sum())


def hash_tensors(*tensors) -> int:
    return sum(hash_tensor(t) for t in tensors if t is not None)


def count_bytes(*tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            total += count_bytes(*t)
        elif t is not None:
            total += t.numel() * t.element_size()
    return total
