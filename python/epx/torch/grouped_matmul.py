"""Grouped matmul over expert-major groups (grouped_mm): torch's grouped
kernel where it runs, else a loop op with its own backward."""
import torch as _torch
from torch import Tensor

from .autograd import _autograd
from .profiling import _ranged
from .tensors import _I32


def _group_bounds(ends):
    return [0] + [int(e) for e in ends.tolist()]


@_torch.library.custom_op("epx::grouped_mm_loop", mutates_args=())
@_ranged("epx::grouped_mm_loop")
def _grouped_mm_loop_op(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    """One torch.mm per group; rows past ends[-1] are zeros. It reads the
    group ends on the host (a device wait on CUDA), inside the op, so
    torch.compile traces through it without a graph break."""
    out = x.new_zeros((x.shape[0], w.shape[2]))
    bounds = _group_bounds(ends)
    for e in range(w.shape[0]):
        start, end = bounds[e], bounds[e + 1]
        if end > start:
            out[start:end] = x[start:end] @ w[e]
    return out


@_grouped_mm_loop_op.register_fake
def _grouped_mm_loop_fake(x, w, ends):
    return x.new_empty((x.shape[0], w.shape[2]))


@_torch.library.custom_op("epx::grouped_mm_weight_grad", mutates_args=())
@_ranged("epx::grouped_mm_weight_grad")
def _grouped_mm_weight_grad_op(x: Tensor, grad_out: Tensor, ends: Tensor) -> Tensor:
    """grad_w[e] = x[group e]^T @ grad_out[group e] -> [G, in, out]."""
    G = ends.shape[0]
    out = x.new_zeros((G, x.shape[1], grad_out.shape[1]))
    bounds = _group_bounds(ends)
    for e in range(G):
        start, end = bounds[e], bounds[e + 1]
        if end > start:
            out[e] = x[start:end].t() @ grad_out[start:end]
    return out


@_grouped_mm_weight_grad_op.register_fake
def _grouped_mm_weight_grad_fake(x, grad_out, ends):
    return x.new_empty((ends.shape[0], x.shape[1], grad_out.shape[1]))


def _grouped_mm_loop_grads(ctx, s, pair, grad_out):
    """x's gradient is the loop over w transposed, w's the per-group x^T @ grad."""
    loop, weight_grad = pair
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = loop(grad_out, s.w.transpose(-2, -1), s.ends)
    if ctx.needs_input_grad[1]:
        grad_w = weight_grad(s.x, grad_out, s.ends).to(s.w.dtype)
    return {"x": grad_x, "w": grad_w}


_autograd(_grouped_mm_loop_op, _grouped_mm_loop_grads)


def _strides_16(t):
    return all((s * t.element_size()) % 16 == 0 for s in t.stride() if s != 1)


def _grouped_mm_on_cpu():
    """Whether this torch has torch._grouped_mm for bfloat16 CPU tensors
    (2.9 on)."""
    try:
        bf16 = _torch.bfloat16
        _torch._grouped_mm(_torch.zeros(4, 8, dtype=bf16), _torch.zeros(1, 8, 8, dtype=bf16),
                           offs=_torch.tensor([4], dtype=_I32))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


_GROUPED_MM_CPU = _grouped_mm_on_cpu()


def _compiling():
    is_compiling = getattr(getattr(_torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling and is_compiling())


def grouped_mm(x, w, ends):
    """out[r] = x[r] @ w[e] for the rows r of group e, the groups being
    [ends[e-1], ends[e]) (ends int32 [G], on x's device); rows past ends[-1]
    are left unspecified. w [G, in, out] may be a transposed view of
    [G, out, in] weights (the layout GPU grouped GEMMs want).

    torch._grouped_mm (no host wait, CUDA-graph capturable) for bfloat16,
    and on CUDA for other dtypes in eager code; otherwise the custom op
    epx::grouped_mm_loop (one mm per group, the group ends read on the
    host). Some torch versions (2.11) trace torch._grouped_mm only for
    bfloat16 (its fake kernel refuses float32) even where the eager kernel
    takes float32; CPU float32 takes the loop compiled or not, so eager and
    compiled runs give the same bits."""
    gm = getattr(_torch, "_grouped_mm", None)
    native = gm is not None and _strides_16(x) and _strides_16(w) and (
        (x.dtype == _torch.bfloat16 and (x.is_cuda or _GROUPED_MM_CPU))
        or (x.is_cuda and not _compiling()))
    if native:
        return gm(x, w, offs=ends)
    return _torch.ops.epx.grouped_mm_loop(x, w, ends)
