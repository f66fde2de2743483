"""The functional API: dispatch and combine over the custom ops (Dispatched,
the overlap and exact-size modes), and make_buffer."""
from typing import NamedTuple, Optional

import torch as _torch
from torch import Tensor

from epx import Device, Status, Weighting
from epx._lib import lib
from epx.errors import _check, _invalid, _refuse
from .checkpointing import RECORDER_AMBIENT, RECORDER_NONE
from .fp8 import _FP8
from .handles import _HANDLES, _handle_id, _handle_of
from .overlap import EventOverlap, _overlapped
from .tensors import epx_dtype, _F32, _I32, _host_values, _on_stream, _ptr, _tensor_args


class Dispatched(NamedTuple):
    """What :func:`dispatch` returns; give it to :func:`combine`.

    Every tensor has the buffer's worst-case row count N_max
    (epx_buffer_max_recv_rows); rows past the valid count N are zeros
    (recv_expert -1). Counts stay on the buffer's device. With
    ``dispatch(..., exact_size=True)`` they have exactly N rows instead."""
    recv_x: Tensor       # [N_max, H] received rows in the buffer's layout
    recv_w: Tensor       # [N_max] float32 weight of each row ([N_max, K] rank-major);
    #                      differentiable: its gradient reaches topk_w (epx_weights_backward)
    recv_expert: Tensor  # [N_max] int32 global expert id of each row, -1 for padding
    counts: Tensor       # [E_local] int64 rows per local expert (before padding)
    offsets: Tensor      # [E_local + 1] int64 first row of each expert's group; offsets[-1] = N
    recv_rows: Tensor    # [1] int64 N, on the buffer's device
    handle_id: Tensor    # [1] int64 (CPU): the id of the dispatch's handle, for combine and
    #                      backward (not a token index: recv_source() gives those)
    topk_w: Optional[Tensor]
    num_tokens: int
    top_k: int
    weighting: int
    buffer_id: int
    recv_scales: Optional[Tensor] = None  # fp8 dispatch: [N_max, scale_cols] scales of recv_x's
    #                                       rows (recv_x is then float8_e4m3fn), else None
    event: Optional["EventOverlap"] = None  # an overlapped dispatch's completion (previous_event,
    #                                         async_finish or comm_stream), else None

    def handle(self):
        """The epx.Handle of this dispatch (eager code only)."""
        return _handle_of(self.handle_id, "Dispatched.handle")

    def recv_source(self):
        """(src_rank, src_token): the source rank and token of each received
        row, [N_max] int32 each on the buffer's device, -1 for padding and
        past the valid rows (epx_handle_recv_source; on CUDA too, with no
        host wait)."""
        fn = "Dispatched.recv_source"
        h = _handle_of(self.handle_id, fn)
        b = h.buffer
        rows, dev = self.recv_x.shape[0], self.recv_x.device
        rank = _torch.full((rows,), -1, dtype=_I32, device=dev)
        token = _torch.full((rows,), -1, dtype=_I32, device=dev)
        _on_stream(b, dev)
        _check(lib.epx_handle_recv_source(h._use(b, fn), _ptr(rank), _ptr(token)))
        return rank, token

    def recv_rows_host(self):
        """N as a Python int (waits for the device on CUDA). Read through the
        handle (epx_handle_recv_rows): from then on recv tensors of exactly N
        rows are enough for its cached dispatches (epx.h), where before the
        bound N_max is required. A released handle's N is read from recv_rows."""
        h = _HANDLES.get(_handle_id(self.handle_id))
        return h.recv_rows if h is not None and not h.released else int(self.recv_rows[0])

    def counts_host(self):
        """Rows per local expert as a list of ints (waits for the device on
        CUDA, except after an exact-size dispatch: its row count's wait
        brought them)."""
        h = _HANDLES.get(_handle_id(self.handle_id))
        got = getattr(h, "_counts_host", None)
        if got is None:
            return [int(c) for c in self.counts.tolist()]
        return _host_values(got).tolist()   # (its event done already where the row count was read)


def _dispatch_fresh(buffer, x, topk_idx, topk_w, locations, weighting, recorder, x_scales,
                    quantize, exact_size):
    """A layout and its payload (see :func:`dispatch`)."""
    if recorder is None:
        rid = RECORDER_AMBIENT
    elif recorder is False:
        rid = RECORDER_NONE
    else:
        rid = recorder.id
    T, K = topk_idx.shape
    if _fp8_payload("epx.torch.dispatch", x, x_scales, quantize):
        outs = _torch.ops.epx.dispatch_fp8(x, x_scales, topk_idx, topk_w, locations, buffer.id,
                                           int(weighting), rid)
        return Dispatched(outs[0], *outs[2:], topk_w, T, K, int(weighting), buffer.id, outs[1])
    op = _torch.ops.epx.dispatch_exact if exact_size else _torch.ops.epx.dispatch
    outs = op(x, topk_idx, topk_w, locations, buffer.id, int(weighting), rid)
    return Dispatched(*outs, topk_w, T, K, int(weighting), buffer.id)


def _fp8_payload(fn, x, x_scales, quantize):
    """Whether a dispatch moves fp8 rows (x float8_e4m3fn with x_scales, or
    quantize=True), refusing the mixes by name."""
    if quantize or (_FP8 is not None and isinstance(x, Tensor) and x.dtype == _FP8):
        if quantize and x_scales is not None:
            _invalid("%s: x_scales is given with quantize=True; quantizing makes the scales "
                     "(pass x of the buffer's dtype)", fn)
        if not quantize and x_scales is None:
            _invalid("%s: x is float8_e4m3fn but x_scales is None; pass its scales "
                     "(epx.fp8_scale_shape), or x of the buffer's dtype with quantize=True", fn)
        return True
    if x_scales is not None:
        _invalid("%s: x_scales is given but x is %s; pass x as torch.float8_e4m3fn", fn,
                 getattr(x, "dtype", type(x).__name__))
    return False


def _dispatch_again(buffer, d, x, x_scales, quantize, extra):
    """x along the layout of an earlier dispatch `d` (epx::dispatch_cached,
    or epx::dispatch_fp8_cached for fp8 rows: DeepEP's cached dispatch of
    an fp8 x)."""
    fn = "epx.torch.dispatch"
    if not isinstance(d, Dispatched):
        raise TypeError("%s: handle is a %s; pass the Dispatched of an earlier dispatch on this "
                        "buffer" % (fn, type(d).__name__))
    if extra:
        _invalid("%s: %s given with handle=; a dispatch on a handle takes only x (with "
                 "x_scales or quantize for fp8 rows; the routing, weights and sizes are the "
                 "handle's)", fn, ", ".join(extra))
    if d.buffer_id != buffer.id:
        _invalid("%s: the handle's dispatch was on buffer %d, not on buffer %d; pass the "
                 "buffer it was made on", fn, d.buffer_id, buffer.id)
    if _fp8_payload(fn, x, x_scales, quantize):
        recv_q, recv_s = _torch.ops.epx.dispatch_fp8_cached(x, x_scales, d.handle_id,
                                                            d.recv_x.shape[0], d.top_k, buffer.id)
        return d._replace(recv_x=recv_q, recv_scales=recv_s, event=None)
    recv_x = _torch.ops.epx.dispatch_cached(x, d.handle_id, d.recv_x.shape[0], d.top_k)
    return d._replace(recv_x=recv_x, recv_scales=None, event=None)


def dispatch(buffer, x, topk_idx=None, topk_w=None, locations=None, *,
             weighting=Weighting.IN_COMBINE, recorder=None, x_scales=None, quantize=False,
             handle=None, exact_size=False, previous_event=None, async_finish=False,
             comm_stream=None):
    """Layout and payload of a dispatch in one op (epx_dispatch_layout +
    epx_dispatch, collective): x [T, H] -> :class:`Dispatched`.

    topk_idx [T, K] (any integer dtype), topk_w [T, K] float32 (None only
    with Weighting.NONE), locations [T, K] for the capacity layout, on the
    buffer's device. Differentiable in x and in topk_w (through recv_w under
    every weighting; through dispatch's own backward with IN_DISPATCH).
    recorder: an epx.Recorder, or None for the :func:`checkpoint_context`
    one if any (False: never).

    FP8 (a buffer with an fp8_format): x float8_e4m3fn [T, H] with x_scales
    [T, scale_cols] (float32 per 128, int32 words of 4 UE8M0 bytes per 512,
    uint8 E8M0 per 32: epx.fp8_scale_shape), or x of the buffer's dtype with
    quantize=True (quantized on the way, epx_dispatch_quantize); recv_x is
    then float8_e4m3fn and recv_scales its scales, each row's beside it.
    The fp8 rows get no gradient (combine and the backward passes stay in
    the buffer's dtype); recv_w's still reaches topk_w.

    FP8 x may also be DeepEP's tuple, x=(x_q, x_scales).

    handle: a :class:`Dispatched` of an earlier dispatch on this buffer:
    dispatch x [T, H] again along its layout (epx_dispatch on the same
    handle: no layout, no count exchange; DeepEP's cached dispatch), e.g. a
    second activation of the same tokens. Only x is given then (with
    x_scales, or quantize=True, for fp8 rows on an fp8 buffer, whatever the
    handle's first dispatch moved: epx_dispatch_fp8 / epx_dispatch_quantize
    on the handle); the result shares the handle (combine either).
    Differentiable in x (fp8 rows: none, as above); the routing weights get
    no second gradient through it.

    exact_size: receive tensors of exactly N rows (the rows this rank
    receives) instead of the worst case N_max, at the cost of one host sync
    (the layout's row count is read on the host before they are made);
    the values are the same. Memory per mode, for H-wide rows of b bytes:
    worst case (default) N_max * (H*b + 8) bytes per dispatch, N_max =
    epx_buffer_max_recv_rows = W * max_tokens_per_rank * min(top_k, E_local)
    for expert-major, always allocated, no host sync, capturable in a CUDA
    graph and traced by torch.compile with static shapes; exact N * (H*b + 8)
    bytes (N is the actual count, typically about T * top_k for balanced
    routing), one host sync per dispatch (torch.compile traces it with a
    data-dependent row count; not capturable in a CUDA graph).

    Overlap (DeepEP's previous_event / async_finish): with any of
    previous_event (an :class:`EventOverlap` to wait for instead of the
    current stream's work), async_finish (the current stream does not wait
    for the dispatch; call ``d.event.current_stream_wait()`` before using
    its outputs) or comm_stream (default: epx's stream of the device), the
    dispatch runs on the communication stream and ``d.event`` is its
    completion; work issued on the current stream after the call overlaps
    it. Without them it runs on the current stream and ``d.event`` is None.
    On CPU every op is done when it returns (the event is a no-op)."""
    fn = "epx.torch.dispatch"
    if isinstance(x, tuple):
        # DeepEP's fp8 x: (x_q, x_scales)
        if len(x) != 2 or x_scales is not None:
            _invalid("%s: x is a tuple of %d%s; pass (x_q, x_scales) as DeepEP takes it, or "
                     "x_q with x_scales=", fn, len(x),
                     " and x_scales is given too" if x_scales is not None else "")
        x, x_scales = x
    _tensor_args(fn, dict(x=x), dict(topk_idx=topk_idx, topk_w=topk_w, locations=locations,
                                     x_scales=x_scales))
    if topk_idx is not None and topk_idx.dim() != 2:
        _invalid("%s: topk_idx has shape %s; pass [T, K], K expert ids per token (for top-1, "
                 "topk_idx.view(-1, 1))", fn, list(topk_idx.shape))
    if handle is not None:
        extra = [name for name, v in (("topk_idx", topk_idx), ("topk_w", topk_w),
                                      ("locations", locations),
                                      ("exact_size", exact_size or None)) if v is not None]

        def call():
            return _dispatch_again(buffer, handle, x, x_scales, quantize, extra)
    else:
        if topk_idx is None:
            _invalid("%s: topk_idx is None; pass the routing [T, K], or handle= an earlier "
                     "Dispatched to dispatch again along its layout", fn)
        if exact_size and (quantize or x_scales is not None):
            _refuse(Status.ERROR_UNSUPPORTED, "%s: exact_size with an fp8 dispatch is not "
                    "offered; drop exact_size", fn)

        def call():
            return _dispatch_fresh(buffer, x, topk_idx, topk_w, locations, weighting, recorder,
                                   x_scales, quantize, exact_size)
    if previous_event is None and not async_finish and comm_stream is None:
        return call()
    d, event = _overlapped(fn, x.device, previous_event, async_finish, comm_stream,
                           (x, topk_idx, topk_w, locations, x_scales), call)
    return d._replace(event=event)


def combine(d, expert_out, *, previous_event=None, async_finish=False, comm_stream=None,
            return_event=None):
    """expert_out [N_max, H] (the rows of ``d.recv_x``, transformed) -> out
    [T, H] = sum_k w[t,k] * expert_out(t,k) (epx_combine, collective; w = 1
    unless the weights are applied in combine). Differentiable in expert_out
    and, with Weighting.IN_COMBINE, in the routing weights: grad_w reaches the
    router.

    Overlap as :func:`dispatch`: previous_event, async_finish, comm_stream;
    then (out, event) is returned when return_event (default: async_finish),
    else out."""
    if not isinstance(d, Dispatched):
        raise TypeError("epx.torch.combine: d is a %s; pass the Dispatched that "
                        "epx.torch.dispatch returned (for the ll buffers: epx.torch.ll_combine)"
                        % type(d).__name__)
    _tensor_args("epx.torch.combine", dict(expert_out=expert_out), {})
    w = d.topk_w if d.weighting == Weighting.IN_COMBINE else None

    def call():
        return _torch.ops.epx.combine(expert_out, w, d.handle_id, d.num_tokens, d.weighting)
    if previous_event is None and not async_finish and comm_stream is None:
        return (call(), EventOverlap()) if return_event else call()
    out, event = _overlapped("epx.torch.combine", expert_out.device, previous_event, async_finish,
                             comm_stream, (expert_out, w), call)
    return (out, event) if (async_finish if return_event is None else return_event) else out


def make_buffer(comm, *, hidden, num_experts, max_top_k, max_tokens_per_rank, dtype=_F32,
                device="cpu", **fields):
    """An epx.Buffer for the torch ops: dtype may be a torch dtype; device
    "cuda" makes a CUDA buffer on the current stream with worst_case_sizing
    (no host waits, CUDA-graph capturable)."""
    dev = _torch.device(device)
    if dev.type == "cuda":
        fields.setdefault("worst_case_sizing", 1)
        fields.setdefault("stream", _torch.cuda.current_stream(dev).cuda_stream)
        fields["device"] = Device.CUDA
    return comm.buffer(hidden=int(hidden), num_experts=int(num_experts),
                       max_top_k=int(max_top_k), max_tokens_per_rank=int(max_tokens_per_rank),
                       dtype=epx_dtype(dtype), **fields)
