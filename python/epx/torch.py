"""epx for PyTorch: routing, dispatch and combine as custom ops with autograd,
an MoE layer, a Megatron-shaped token dispatcher, torch.distributed comms and
activation-checkpoint replay.

Every library call is a ``torch.library`` custom op (``torch.ops.epx.*``)
with a fake (meta) implementation, so ``torch.compile`` traces a whole layer
without graph breaks, and no op waits on the device from the host:

- receive tensors are sized for the buffer's worst case
  (``epx_buffer_max_recv_rows``; rows past the valid count are zeros), and the
  valid row count and per-expert counts stay tensors on the buffer's device
  (:meth:`Dispatched.recv_rows_host` / :meth:`Dispatched.counts_host` ask for
  host values); ``exact_size=True`` trades one host sync for receive tensors
  of exactly the received rows;
- the aux- and z-loss gradients reach the router as tensors.

A layer step by hand::

    import epx, epx.torch as et
    r = et.route(logits, top_k=2)                         # differentiable in topk_w, losses
    d = et.dispatch(buffer, x, r.topk_idx, r.topk_w)      # d.recv_x [N_max, H], by local expert
    expert_out = my_experts(d.recv_x, d.offsets)          # groups [offsets[e], offsets[e+1])
    out = et.combine(d, expert_out)                       # sum_k w[t,k] * expert_out(t,k)
    (out * grad).sum().backward()                         # x.grad, logits.grad (the router learns)

Where the routing weights are applied is the handle's weighting: in combine
(default: combine's backward gives their gradient), in dispatch, or by the
expert (Weighting.NONE): the expert multiplies by ``d.recv_w``, which is an
autograd output of dispatch whose backward is epx_weights_backward, so the
router learns whichever side applies the weights.

dispatch, combine and their backward passes are collective: every rank runs
the same graph. CUDA tensors need a libepx built with EPX_BUILD_CUDA; every
call runs on PyTorch's current stream, unless dispatch/combine are given
previous_event, async_finish or comm_stream (then on a communication stream,
returning an :class:`EventOverlap`, as DeepEP). Importing this module imports torch
first, so a libepx linked with NCCL binds to torch's NCCL.
"""
import contextlib
import collections
import ctypes
import functools
import itertools
import math
import os
import threading
import time
import weakref
from typing import NamedTuple, Optional, Tuple

import torch as _torch
import torch.nn.functional as _F
from torch import Tensor
import numpy as _np

import epx as _epx
from epx import _lib
from epx import DType, Device, Exchange, Layout, Status, Weighting

__all__ = ["route", "dispatch", "combine", "Dispatched", "TorchRouteResult", "MoE",
           "TokenDispatcher", "checkpoint_context", "keep_handles", "comm_from_process_group",
           "init_process_group", "launch_env", "EventOverlap", "current_event", "stats",
           "make_buffer", "grouped_mm", "epx_dtype", "torch_dtype", "ll_dispatch", "ll_combine",
           "dequantize"]

lib = _lib.lib

_DTYPES = {_torch.float32: DType.FLOAT32, _torch.bfloat16: DType.BFLOAT16,
           _torch.float16: DType.FLOAT16}
_TORCH_OF = {v: k for k, v in _DTYPES.items()}
_I32, _I64, _F32 = _torch.int32, _torch.int64, _torch.float32


def epx_dtype(dtype):
    """The epx DType of a torch dtype (float32, bfloat16, float16), or of
    anything epx accepts as a dtype."""
    return _epx._as_dtype(dtype)


def torch_dtype(dtype):
    """The torch dtype of an epx dtype (or of a torch dtype: itself)."""
    return _TORCH_OF[_epx._as_dtype(dtype)]


# ---------------------------------------------------------------------------
# Argument checks (in the binding's words: function, argument, fix)
# ---------------------------------------------------------------------------


def _device_kind(buffer_device):
    return "cuda" if buffer_device == Device.CUDA else "cpu"


def _check_device(t, fn, name, buffer_device):
    want = _device_kind(buffer_device)
    if t.device.type != want:
        if t.device.type == "cuda" and not _epx.has_cuda():
            _epx._refuse(Status.ERROR_UNSUPPORTED, "%s: %s is a CUDA tensor but this libepx (%s) "
                         "has no CUDA backend; build it with -DEPX_BUILD_CUDA=ON (pip install "
                         "./python does when nvcc is found)", fn, name, _epx.library_path)
        _epx._invalid("%s: %s is on %s but the buffer is a %s buffer; move it with .to(%r)", fn,
                      name, t.device, want.upper(), want)


def _tensor(t, fn, name, dtype, shape, buffer_device, align=4, optional=False):
    """A tensor argument made usable by the library: checked for type, dtype,
    shape and device; made contiguous and aligned (copying) when it is not."""
    if t is None:
        if optional:
            return None
        _epx._invalid("%s: %s is None; pass a %s tensor of shape %s", fn, name, dtype,
                      _epx._shape_text(shape))
    if not isinstance(t, _torch.Tensor):
        _epx._invalid("%s: %s is a %s; pass a torch.Tensor", fn, name, type(t).__name__)
    _check_device(t, fn, name, buffer_device)
    if t.dtype != dtype:
        _epx._invalid("%s: %s has dtype %s; pass %s (convert with .to(%s))", fn, name, t.dtype,
                      dtype, dtype)
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        _epx._invalid("%s: %s has shape %s; expected %s", fn, name, list(t.shape),
                      _epx._shape_text(shape))
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() and t.data_ptr() % align:
        t = t.clone()
    return t


def _tensor_args(fn, required, optional):
    """Refuses, by name, an argument that is not a tensor before it reaches
    a custom op (whose own refusal would be torch's schema error)."""
    for name, t in list(required.items()) + list(optional.items()):
        if not isinstance(t, _torch.Tensor) and (t is not None or name in required):
            _epx._invalid("%s: %s is %s; pass a torch.Tensor", fn, name,
                          "None" if t is None else "a " + type(t).__name__)


def _routing_tensor(t, fn, name, dtype, shape, buffer_device, optional=False, high=None):
    """A routing tensor as the dtype the library reads: weights of any
    numeric dtype; expert ids and locations (dtype int32) of an integer
    dtype, checked in that dtype before the conversion (_ids; high: E for
    ids)."""
    if t is None and optional:
        return None
    if not isinstance(t, _torch.Tensor):
        _tensor(t, fn, name, dtype, shape, buffer_device)
    _check_device(t, fn, name, buffer_device)
    t = t.detach()
    if dtype == _I32:
        t = _ids(t, fn, name, high)
    return _tensor(t.to(dtype), fn, name, dtype, shape, buffer_device)


_INT32_MAX = 2 ** 31 - 1


def _ids(t, fn, name, high):
    """Ids or locations in the caller's dtype, before they become the int32
    the library reads (a cast would send the id 2**32 + 1 to expert 1 and
    1.9 to 1): a non-integer dtype is refused; so is, on the CPU, a value
    outside [-1, high) (high None: int32's range; the library checks
    locations against C itself), naming it. On CUDA reading the values would
    wait for the device, so values past int32 become INT32_MAX, which the
    library refuses (with worst_case_sizing: drops and reports) as the
    out-of-range route it is."""
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == _torch.bool:
        _epx._invalid("%s: %s has dtype %s; pass an integer tensor (int32 or int64)", fn, name,
                      t.dtype)
    if t.dtype == _I32 or t.numel() == 0:
        return t
    top = _INT32_MAX if high is None else high - 1
    unsigned = _torch.iinfo(t.dtype).min == 0  # (compared with -1, -1 would become 255)
    if t.device.type == "cuda":
        fits = t <= _INT32_MAX if unsigned else (t >= -1) & (t <= _INT32_MAX)
        return _torch.where(fits, t, _torch.full_like(t, _INT32_MAX))
    bad = (t > top if unsigned else (t < -1) | (t > top)).nonzero()
    if len(bad):
        at = tuple(int(i) for i in bad[0])
        _epx._invalid("%s: %s%s is %d, outside [-1, %d]; pass %s", fn, name, list(at),
                      int(t[at]), top, "expert ids of the buffer's %d experts (-1: none)" % high
                      if high is not None else "values that fit int32")
    return t


def _ptr(t):
    return t.data_ptr() if t is not None and t.numel() else None


def _on_stream(buffer, device):
    """CUDA buffers run on PyTorch's current stream of the tensors' device.
    Changing a buffer's stream orders the new one after the old one (an
    event wait), which a stream being captured into a CUDA graph cannot do
    with an event from outside the capture: refused with the fix."""
    if buffer.device != Device.CUDA:
        return
    stream = _torch.cuda.current_stream(device).cuda_stream
    if stream == buffer.stream:
        return
    if _torch.cuda.is_current_stream_capturing():
        _epx._refuse(Status.ERROR_UNSUPPORTED, "epx.torch: buffer %d gets a new CUDA stream "
                     "inside a CUDA graph capture; run a warm-up step on the capture stream "
                     "first (with torch.cuda.stream(s): step(); then torch.cuda.graph(g, "
                     "stream=s))", buffer.id)
    buffer.set_stream(stream)


def _buffer(buffer_id, fn):
    b = _epx._BUFFERS.get(int(buffer_id))
    if b is None or b.closed:
        _epx._refuse(Status.ERROR_INVALID_HANDLE, "%s: buffer %d was closed (or never made); "
                     "keep the epx.Buffer open while the layer uses it", fn, buffer_id)
    return b


def _sized_buffer(buffer, fn):
    """The ops size their receive tensors for the buffer's worst case before
    any exchange (torch.compile's fake tensors need it), so a buffer made
    without max_tokens_per_rank is refused in eager code as in compiled."""
    if not buffer.config.max_tokens_per_rank:
        _epx._invalid("%s: buffer %d was made without max_tokens_per_rank, so its receive size "
                      "is not known before the first exchange; make it with "
                      "epx.torch.make_buffer(..., max_tokens_per_rank=...) (or "
                      "comm.buffer(max_tokens_per_rank=...))", fn, buffer.id)


def _max_rows(buffer, fn):
    """Rows of every receive tensor: the buffer's worst case."""
    try:
        return buffer.max_recv_rows()
    except _epx.EpxError as e:
        _epx._invalid("%s: the buffer's receive size is not known yet (%s); give the buffer "
                      "max_tokens_per_rank (epx.torch.make_buffer / MoE(max_tokens_per_rank=...)) "
                      "so its worst case is known before the first call, as torch.compile needs",
                      fn, e.message)


def _handle_rows(h, b, fn):
    """The fewest rows a tensor of handle h's receive layout must have: N
    where the host knows it (CPU buffers; an exact-size dispatch, which read
    it), else the worst case N_max that dispatch returned (on CUDA N lives on
    the device, and reading it would wait for it)."""
    if b.device == Device.CPU or h._recv_rows is not None:
        return h.recv_rows
    return _max_rows(b, fn)


def _check_handle_rows(rows, h, b, fn, name):
    """A tensor's rows against the handle before any C call: the library
    reads (or writes) N rows of it, so fewer would be out of bounds (and,
    over several ranks, one rank's garbage would reach another's tokens);
    more than any dispatch on the buffer receives is not a recv_x's either."""
    need, most = _handle_rows(h, b, fn), _max_rows(b, fn)
    if not need <= rows <= max(need, most):
        _epx._invalid("%s: %s has %d rows; the dispatch received %d (any dispatch on this buffer "
                      "at most %d): pass a row for every row of the Dispatched's recv_x, as "
                      "dispatch returned it", fn, name, rows, need, most)


def _check_handle_shape(h, fn, num_tokens, top_k=None):
    """The numbers an op got beside its handle (from a Dispatched) against
    the handle's own."""
    if num_tokens != h.num_tokens or (top_k is not None and top_k != h.top_k):
        _epx._invalid("%s: the dispatch had %d tokens and top_k %d, not %d and %s; pass the "
                      "Dispatched that dispatch returned, unchanged", fn, h.num_tokens, h.top_k,
                      num_tokens, top_k if top_k is not None else h.top_k)


def _recv_w_shape(buffer, rows, top_k):
    return (rows, top_k) if buffer.layout == Layout.RANK_MAJOR else (rows,)


# ---------------------------------------------------------------------------
# Profiler ranges and call statistics: every epx op is a torch.profiler range
# (record_function) and, on CUDA, an NVTX range of the same name, and counts
# in stats()
# ---------------------------------------------------------------------------

_STATS = {}
_stats_lock = threading.Lock()


@contextlib.contextmanager
def _op_range(name, device):
    cuda = device is not None and device.type == "cuda"
    start = time.perf_counter()
    with _torch.profiler.record_function(name):
        if cuda:
            _torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if cuda:
                _torch.cuda.nvtx.range_pop()
            seconds = time.perf_counter() - start
            with _stats_lock:
                entry = _STATS.setdefault(name, {"calls": 0, "host_seconds": 0.0})
                entry["calls"] += 1
                entry["host_seconds"] += seconds


def _ranged(name):
    """The decorator of every custom op's implementation: its profiler range
    and its count in stats() (the schema comes from the wrapped function)."""
    def wrap(f):
        @functools.wraps(f)
        def op(*args, **kwargs):
            dev = next((a.device for a in args if isinstance(a, Tensor)), None)
            with _op_range(name, dev):
                return f(*args, **kwargs)
        return op
    return wrap


def stats(reset=False):
    """Calls and host seconds of each epx op in this process since import (or
    the last reset): ``{"epx::dispatch": {"calls": 3, "host_seconds": 0.01},
    ...}``. On CUDA the host seconds are launch (and, with exact-size
    outputs, sync) time; the device time is in a torch.profiler trace or an
    Nsight Systems timeline, under the same names (record_function and NVTX
    ranges)."""
    with _stats_lock:
        out = {k: dict(v) for k, v in _STATS.items()}
        if reset:
            _STATS.clear()
    return out


# ---------------------------------------------------------------------------
# Overlap: ops on a communication stream, ordered by events (DeepEP's
# previous_event / async_finish / EventOverlap)
# ---------------------------------------------------------------------------


class EventOverlap:
    """The completion of an epx op, as DeepEP's EventOverlap: a CUDA event
    recorded on the stream the op ran on (None on CPU, where every op has
    finished when it returns), and the tensors to keep alive until it is
    waited on.

    ``event.current_stream_wait()`` makes the current stream wait for the op
    (the caller triggers the completion of an ``async_finish`` op);
    ``with event:`` does so at the end of the block, so work issued inside it
    overlaps the op; ``synchronize()`` waits on the host."""

    def __init__(self, event=None, extra_tensors=()):
        self.event = event
        self.extra_tensors = tuple(extra_tensors)

    def current_stream_wait(self):
        if self.event is not None:
            _torch.cuda.current_stream().wait_event(self.event)
        self.extra_tensors = ()

    def synchronize(self):
        if self.event is not None:
            self.event.synchronize()

    def query(self):
        """Whether the op has finished (True on CPU)."""
        return self.event is None or self.event.query()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.current_stream_wait()


def current_event():
    """An :class:`EventOverlap` of the work issued so far on the current
    CUDA stream (None-event on a machine without CUDA): pass it as an op's
    previous_event."""
    if not _torch.cuda.is_available():
        return EventOverlap()
    event = _torch.cuda.Event()
    event.record(_torch.cuda.current_stream())
    return EventOverlap(event)


_COMM_STREAMS = {}


def _comm_stream(dev):
    """epx's communication stream of a CUDA device (one per device, made on
    first use), where async and event-ordered ops run."""
    index = dev.index if dev.index is not None else _torch.cuda.current_device()
    if index not in _COMM_STREAMS:
        _COMM_STREAMS[index] = _torch.cuda.Stream(device=index)
    return _COMM_STREAMS[index]


def _tensors_of(value):
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors_of(v)]
    return []


def _overlapped(fn, dev, previous_event, async_finish, comm_stream, inputs, call):
    """Runs call() (epx ops on tensors of `dev`) and returns (its result, an
    EventOverlap). Without previous_event, async_finish or comm_stream it runs
    on the current stream, as every op does by default (graph-friendly).
    Otherwise on comm_stream (default: epx's stream of the device), after
    previous_event (default: the current stream's work so far); the current
    stream waits for it at once unless async_finish, when the caller does
    (``event.current_stream_wait()``). Inputs are marked as used on the comm
    stream and outputs on the current one, so the caching allocator reuses
    neither early."""
    if previous_event is not None and not isinstance(previous_event, EventOverlap):
        raise TypeError("%s: previous_event is a %s; pass an epx.torch.EventOverlap (from an "
                        "op's event, or epx.torch.current_event())"
                        % (fn, type(previous_event).__name__))
    if dev.type != "cuda":
        if comm_stream is not None:
            _epx._invalid("%s: comm_stream is given but the tensors are on %s; streams are for "
                          "CUDA tensors", fn, dev)
        if previous_event is not None:
            previous_event.synchronize()  # a CUDA event before a CPU op: wait on the host
        result = call()
        return result, EventOverlap()
    compute = _torch.cuda.current_stream(dev)
    if comm_stream is None and previous_event is None and not async_finish:
        result = call()
        event = _torch.cuda.Event()
        event.record(compute)
        return result, EventOverlap(event)
    side = comm_stream if comm_stream is not None else _comm_stream(dev)
    if previous_event is not None and previous_event.event is not None:
        side.wait_event(previous_event.event)
    else:
        side.wait_stream(compute)
    with _torch.cuda.stream(side):
        result = call()
    outputs = [t for t in _tensors_of(result) if t.is_cuda]
    for t in _tensors_of(inputs):
        if t.is_cuda:
            t.record_stream(side)
    for t in outputs:
        t.record_stream(compute)
    event = _torch.cuda.Event()
    event.record(side)
    if not async_finish:
        compute.wait_event(event)
    return result, EventOverlap(event, _tensors_of(inputs) + outputs)


# ---------------------------------------------------------------------------
# Handle tokens: a handle travels between ops as a 1-element int64 CPU tensor
# whose storage owns the epx.Handle, so the handle lives exactly as long as
# some tensor (an output, or a tensor autograd saved for backward) needs it.
# ---------------------------------------------------------------------------

_HANDLES = weakref.WeakValueDictionary()
_handle_ids = itertools.count(1)


class _TokenBytes(bytearray):
    """The 8 bytes of a token tensor; `handle` keeps the epx.Handle alive."""


def _token(handle):
    hid = next(_handle_ids)
    _HANDLES[hid] = handle
    handle._autograd = True
    kept = getattr(_kept, "handles", None)
    if kept is not None:
        kept.append(handle)
    raw = _TokenBytes(8)
    raw.handle = handle
    arr = _np.frombuffer(raw, dtype=_np.int64)
    arr[0] = hid
    return _torch.from_numpy(arr)


_kept = threading.local()


class keep_handles:
    """Keeps every handle dispatched in this thread inside the ``with``
    alive afterwards, in the list it yields, for as long as that list lives.

    A CUDA graph replays the kernels of the dispatches it captured, which
    read and write their handles' device memory; autograd releases a handle
    once the backward that needs it has run, so a captured step must keep
    its handles for the graph's lifetime::

        with torch.cuda.stream(side):
            step()                      # warm-up on the capture stream
        with et.keep_handles() as kept, torch.cuda.graph(graph, stream=side):
            loss = step()
        # keep `kept` as long as `graph` (the buffer stays busy meanwhile)
    """

    def __enter__(self):
        self._previous = getattr(_kept, "handles", None)
        self.handles = []
        _kept.handles = self.handles
        return self.handles

    def __exit__(self, *exc):
        _kept.handles = self._previous
        if self._previous is not None:
            self._previous.extend(self.handles)


def _handle_of(token, fn):
    h = _HANDLES.get(int(token[0]))
    if h is None or h.released:
        _epx._refuse(Status.ERROR_INVALID_HANDLE, "%s: the dispatch's handle was released; keep "
                     "the Dispatched result (or the autograd graph) alive until combine and "
                     "backward have run", fn)
    return h


# ---------------------------------------------------------------------------
# Routing: epx::route and epx::route_backward
# ---------------------------------------------------------------------------

# A route config travels to the ops as its id: the struct's bytes in hex (a
# str, which an op takes as an argument and torch.compile keeps as a
# constant). The id holds the whole config, so any op can rebuild it; the
# cache below only saves the decoding, and is bounded: a value that changes
# every step (an annealed aux_loss_coeff, the step's aux_loss_tokens) makes
# a new id every call, and an unbounded table grew by each.
_CONFIGS = collections.OrderedDict()  # id -> RouteConfig, least recently used first
_CONFIGS_KEPT = 256
_config_lock = threading.Lock()


def _config_id(config):
    return ctypes.string_at(ctypes.addressof(config), ctypes.sizeof(config)).hex()


def _config_of(config_id):
    """The RouteConfig of an id (from the cache, or decoded into it)."""
    with _config_lock:
        config = _CONFIGS.get(config_id)
        if config is not None:
            _CONFIGS.move_to_end(config_id)
            return config
        config = _lib.RouteConfig.from_buffer_copy(bytes.fromhex(config_id))
        _CONFIGS[config_id] = config
        if len(_CONFIGS) > _CONFIGS_KEPT:
            _CONFIGS.popitem(last=False)
        return config


def _route_config_on(config_id, device, token_mask=None, aux_counts=None):
    """The interned config on the tensors' device and current stream, its
    memory fields pointing at this call's token_mask / aux counts."""
    is_cuda = device.type == "cuda"
    stream = _torch.cuda.current_stream(device).cuda_stream if is_cuda else None
    return _config_of(config_id).copy(device=Device.CUDA if is_cuda else Device.CPU,
                                      stream=stream, token_mask=_ptr(token_mask),
                                      aux_loss_expert_counts=_ptr(aux_counts))


@_torch.library.custom_op("epx::route", mutates_args=())
@_ranged("epx::route")
def _route_op(logits: Tensor, bias: Optional[Tensor], token_mask: Optional[Tensor],
              aux_counts: Optional[Tensor], config_id: str
              ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    config = _route_config_on(config_id, logits.device, token_mask, aux_counts)
    T, E, K = logits.shape[0], int(config.num_experts), int(config.top_k)
    dev = logits.device
    idx, loc = (_torch.empty((T, K), dtype=_I32, device=dev) for _ in range(2))
    w = _torch.empty((T, K), dtype=_F32, device=dev)
    counts = _torch.empty((E,), dtype=_I32, device=dev)
    aux, z = _torch.zeros((), dtype=_F32, device=dev), _torch.zeros((), dtype=_F32, device=dev)
    out = _lib.RouteOutput()
    out.topk_idx, out.topk_w, out.locations = _ptr(idx), _ptr(w), _ptr(loc)
    out.expert_counts, out.aux_loss, out.z_loss = _ptr(counts), aux.data_ptr(), z.data_ptr()
    _epx._check(lib.epx_route(ctypes.byref(config), T, _ptr(logits), _ptr(bias),
                              ctypes.byref(out)))
    info = _torch.tensor([out.capacity, out.nonfinite_tokens], dtype=_I64)
    return idx, w, loc, counts, aux, z, info


@_route_op.register_fake
def _route_fake(logits, bias, token_mask, aux_counts, config_id):
    config = _config_of(config_id)
    T, E, K = logits.shape[0], int(config.num_experts), int(config.top_k)
    return (logits.new_empty((T, K), dtype=_I32), logits.new_empty((T, K), dtype=_F32),
            logits.new_empty((T, K), dtype=_I32), logits.new_empty((E,), dtype=_I32),
            logits.new_empty((), dtype=_F32), logits.new_empty((), dtype=_F32),
            _torch.empty((2,), dtype=_I64, device="cpu"))


@_torch.library.custom_op("epx::route_backward", mutates_args=())
@_ranged("epx::route_backward")
def _route_backward_op(logits: Tensor, bias: Optional[Tensor], token_mask: Optional[Tensor],
                       aux_counts: Optional[Tensor], topk_idx: Tensor,
                       grad_topk_w: Optional[Tensor], grad_aux: Optional[Tensor],
                       grad_z: Optional[Tensor], config_id: str) -> Tensor:
    """d loss / d logits. epx_route_backward takes the losses' gradients as
    host floats; reading them would wait on the device, so the gradient is
    assembled from its linear parts instead: the weights' part, plus
    grad_aux (and grad_z) times the part of a unit loss gradient, with the
    scaling done on the device."""
    config = _route_config_on(config_id, logits.device, token_mask, aux_counts)
    T, E = logits.shape

    def part(gw, ga, gz):
        g = _torch.empty((T, E), dtype=_F32, device=logits.device)
        _epx._check(lib.epx_route_backward(ctypes.byref(config), T, _ptr(logits), _ptr(bias),
                                           _ptr(topk_idx), _ptr(gw), ga, gz, _ptr(g)))
        return g

    grad = part(grad_topk_w, 0.0, 0.0)
    if grad_aux is not None and config.aux_loss_coeff != 0.0:
        grad += grad_aux.to(_F32) * part(None, 1.0, 0.0)
    if grad_z is not None and config.z_loss_coeff != 0.0:
        grad += grad_z.to(_F32) * part(None, 0.0, 1.0)
    return grad


@_route_backward_op.register_fake
def _route_backward_fake(logits, bias, token_mask, aux_counts, topk_idx, grad_topk_w, grad_aux,
                         grad_z, config_id):
    return _torch.empty_like(logits, dtype=_F32)


def _route_setup(ctx, inputs, output):
    logits, bias, token_mask, aux_counts, config_id = inputs
    ctx.set_materialize_grads(False)
    ctx.config_id = config_id
    ctx.save_for_backward(logits, bias, token_mask, aux_counts, output[0])


def _route_backward(ctx, g_idx, g_w, g_loc, g_counts, g_aux, g_z, g_info):
    logits, bias, token_mask, aux_counts, idx = ctx.saved_tensors
    if g_w is not None:
        g_w = g_w.contiguous()
    grad = _torch.ops.epx.route_backward(logits, bias, token_mask, aux_counts, idx, g_w, g_aux,
                                         g_z, ctx.config_id)
    return grad, None, None, None, None


_route_op.register_autograd(_route_backward, setup_context=_route_setup)


class TorchRouteResult(NamedTuple):
    """What :func:`route` returns. topk_w, aux_loss and z_loss are
    differentiable with respect to the logits; capacity is an int and
    nonfinite_tokens a 0-d int64 CPU tensor (neither waits for the device)."""
    topk_idx: Tensor         # [T, K] int32 expert ids, best first; -1 = dropped
    topk_w: Tensor           # [T, K] float32
    locations: Tensor        # [T, K] int32 slot in the expert's queue (capacity mode)
    expert_counts: Tensor    # [E] int32 routes chosen per expert
    aux_loss: Tensor         # 0-d float32 (times aux_loss_coeff)
    z_loss: Tensor           # 0-d float32 (times z_loss_coeff)
    capacity: int            # C in capacity mode, 0 otherwise (an int, as epx.route's)
    nonfinite_tokens: Tensor  # 0-d int64 (CPU): tokens dropped for NaN/Inf logits


_MEMORY_FIELDS = ("token_mask", "aux_loss_expert_counts", "stream")


def _route_tensors(fn, T, E, dev, token_mask, aux_loss_expert_counts):
    """token_mask [T] (bool or uint8, nonzero = a real token) as uint8 and
    aux_loss_expert_counts [E] as float32, on the logits' device."""
    if token_mask is not None:
        if not isinstance(token_mask, _torch.Tensor) or token_mask.shape != (T,):
            _tensor(token_mask, fn, "token_mask", _torch.uint8, (T,), dev)
        _check_device(token_mask, fn, "token_mask", dev)
        token_mask = token_mask.detach().to(_torch.uint8).contiguous()
    if aux_loss_expert_counts is not None:
        # as the mask: checked by shape and device only (no data_ptr, which a
        # torch.compile trace's fake tensor does not have)
        if not isinstance(aux_loss_expert_counts, _torch.Tensor) or aux_loss_expert_counts.shape != (E,):
            _tensor(aux_loss_expert_counts, fn, "aux_loss_expert_counts", _F32, (E,), dev)
        _check_device(aux_loss_expert_counts, fn, "aux_loss_expert_counts", dev)
        aux_loss_expert_counts = aux_loss_expert_counts.detach().to(_F32).contiguous()
    return token_mask, aux_loss_expert_counts


def _route_fields_config(config, shape, fields, fn):
    """The config of a route call, its memory fields cleared (the op passes
    those as tensors; the interned config holds none)."""
    for name in _MEMORY_FIELDS:
        if name in fields:
            _epx._invalid("%s: %s is memory, not a number: pass it as a tensor keyword (%s=...)"
                          " rather than a config field", fn, name,
                          name if name != "stream" else "the current torch stream is used;"
                          " stream")
    config = _epx._route_config(config, shape, fields)
    if config.token_mask or config.aux_loss_expert_counts:
        _epx._invalid("%s: config.token_mask / aux_loss_expert_counts are set; pass them as "
                      "tensors (token_mask=..., aux_loss_expert_counts=...) instead", fn)
    return config.copy(device=Device.CPU, stream=None)


def route(logits, config=None, *, bias=None, token_mask=None, aux_loss_expert_counts=None,
          **fields):
    """Routes T tokens (epx_route) -> :class:`TorchRouteResult`,
    differentiable: backward runs epx_route_backward with the gradients of
    topk_w, aux_loss and z_loss. logits [T, E] float32 on the CPU, or on a GPU
    with a CUDA libepx. config is an epx.RouteConfig; keyword arguments set
    its fields (num_experts defaults to E), every routing option included.
    token_mask [T] (bool/uint8, 0 = padding: routes nowhere, in no loss) and
    aux_loss_expert_counts [E] (the global aux loss's counts; with the
    aux_loss_tokens field) are tensors on the logits' device. On CUDA the
    default nonfinite=Nonfinite.ERROR waits for the device once per call
    (the check's verdict); Nonfinite.DROP does not."""
    fn = "epx.torch.route"
    if not isinstance(logits, _torch.Tensor):
        _epx._invalid("%s: logits is a %s; pass a float32 torch.Tensor [T, E]", fn,
                      type(logits).__name__)
    config = _route_fields_config(config, tuple(logits.shape), fields, fn)
    dev = Device.CUDA if logits.device.type == "cuda" else Device.CPU
    E = int(config.num_experts)
    capacity = _route_capacity(config, logits.shape[0] if logits.dim() else 0)
    if (not isinstance(logits, _torch.Tensor) or logits.dtype != _F32 or logits.dim() != 2
            or (E > 0 and logits.shape[1] != E)):
        _tensor(logits, fn, "logits", _F32, (None, E if E > 0 else None), dev)
    _check_device(logits, fn, "logits", dev)
    if bias is not None:
        bias = _tensor(bias, fn, "bias", _F32, (E,), dev)
    mask, counts = _route_tensors(fn, logits.shape[0], E, dev, token_mask, aux_loss_expert_counts)
    outs = _torch.ops.epx.route(logits.contiguous(), bias, mask, counts, _config_id(config))
    idx, w, loc, counts, aux, z, info = outs
    return TorchRouteResult(idx, w, loc, counts, aux, z, capacity, info[1])


def _route_capacity(config, num_tokens):
    """C of config for num_tokens tokens, a host int (no device wait: it
    depends on the config and T only). The config is checked first, so a
    bad one (top_k=-1, renormalize_after_drop without renormalize) is
    refused in epx_route's words before any tensor is sized from it.
    Dropless configs leave T alone (a traced T stays symbolic)."""
    _epx._route_config_check(config)
    cap = ctypes.c_int32(0)
    tokens = int(num_tokens) if config.capacity_mode else 0
    _epx._check(lib.epx_route_capacity_of(ctypes.byref(config), tokens, ctypes.byref(cap)))
    return cap.value


# ---------------------------------------------------------------------------
# The ambient recorder (checkpoint_context sets it per thread)
# ---------------------------------------------------------------------------

_ambient = threading.local()
RECORDER_AMBIENT = 0   # recorder_id: the checkpoint_context's recorder, if any
RECORDER_NONE = -1     # recorder_id: never record or replay


def _recorder(recorder_id, fn):
    if recorder_id == RECORDER_NONE:
        return None
    if recorder_id == RECORDER_AMBIENT:
        rec = getattr(_ambient, "recorder", None)
        return rec if rec is not None and not rec.closed else None
    rec = _epx._RECORDERS.get(int(recorder_id))
    if rec is None or rec.closed:
        _epx._refuse(Status.ERROR_INVALID_HANDLE, "%s: recorder %d was closed; pass an open "
                     "epx.Recorder", fn, recorder_id)
    return rec


# ---------------------------------------------------------------------------
# Dispatch: epx::dispatch (layout + payload + metadata) and its backward
# ---------------------------------------------------------------------------


def _dispatch_inputs(b, x, topk_idx, topk_w, locations, fn, x_dtype=None):
    dev = b.device
    _sized_buffer(b, fn)
    idx = _routing_tensor(topk_idx, fn, "topk_idx", _I32, (None, None), dev,
                          high=b.num_experts)
    T, K = idx.shape
    w = _routing_tensor(topk_w, fn, "topk_w", _F32, (T, K), dev, optional=True)
    loc = _routing_tensor(locations, fn, "locations", _I32, (T, K), dev, optional=True)
    x = _tensor(x, fn, "x", x_dtype or _TORCH_OF[b.dtype], (T, b.hidden), dev,
                align=_epx.PAYLOAD_ALIGNMENT)
    return x, idx, w, loc


def _recv_metadata(b, handle, rows, K, dev, fn):
    """(recv_w, recv_expert, counts, offsets, N) of a dispatch's handle."""
    shape = _recv_w_shape(b, rows, K)
    recv_expert = _torch.full(shape, -1, dtype=_I32, device=dev)
    recv_w = _torch.zeros(shape, dtype=_F32, device=dev)
    n = b.experts_per_rank
    counts = _torch.empty((n,), dtype=_I64, device=dev)
    offsets = _torch.empty((n + 1,), dtype=_I64, device=dev)
    hp = handle._use(b, fn)
    _epx._check(lib.epx_handle_recv_routing(hp, _ptr(recv_expert), _ptr(recv_w)))
    _epx._check(lib.epx_handle_expert_counts(hp, _ptr(counts), _ptr(offsets)))
    # offsets[-1] is N in every layout: the row count, read on the device.
    return recv_w, recv_expert, counts, offsets, offsets[-1:].clone()


@_torch.library.custom_op("epx::dispatch", mutates_args=())
@_ranged("epx::dispatch")
def _dispatch_op(x: Tensor, topk_idx: Tensor, topk_w: Optional[Tensor],
                 locations: Optional[Tensor], buffer_id: int, weighting: int, recorder_id: int
                 ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    fn = "epx.torch.dispatch"
    b = _buffer(buffer_id, fn)
    with b._together("layout"):
        xc, idx, w, loc = _dispatch_inputs(b, x, topk_idx, topk_w, locations, fn)
        rec = _recorder(recorder_id, fn)
    T, K = idx.shape
    _on_stream(b, x.device)
    handle = b._layout(T, K, _ptr(idx), _ptr(w), _ptr(loc), weighting, rec)
    token = _token(handle)
    rows = _max_rows(b, fn)
    dev = x.device
    recv_x = _torch.zeros((rows, b.hidden), dtype=xc.dtype, device=dev)
    b._dispatch(handle, _ptr(xc), _ptr(recv_x), rows)
    return (recv_x,) + _recv_metadata(b, handle, rows, K, dev, fn) + (token,)


@_dispatch_op.register_fake
def _dispatch_fake(x, topk_idx, topk_w, locations, buffer_id, weighting, recorder_id):
    b = _buffer(buffer_id, "epx.torch.dispatch")
    _sized_buffer(b, "epx.torch.dispatch")
    rows = _max_rows(b, "epx.torch.dispatch")
    shape = _recv_w_shape(b, rows, topk_idx.shape[1])
    n = b.experts_per_rank
    return (x.new_empty((rows, b.hidden)), x.new_empty(shape, dtype=_F32),
            x.new_empty(shape, dtype=_I32), x.new_empty((n,), dtype=_I64),
            x.new_empty((n + 1,), dtype=_I64), x.new_empty((1,), dtype=_I64),
            _torch.empty((1,), dtype=_I64, device="cpu"))


@_torch.library.custom_op("epx::dispatch_backward", mutates_args=())
@_ranged("epx::dispatch_backward")
def _dispatch_backward_op(grad_recv_x: Tensor, x: Optional[Tensor], token: Tensor,
                          num_tokens: int, top_k: int) -> Tuple[Tensor, Tensor]:
    """grad_recv_x -> (grad_x, grad_w); grad_w is computed (weights applied in
    dispatch) when x, the forward's input, is given, else zeros."""
    fn = "epx.torch.dispatch (backward)"
    h = _handle_of(token, fn)
    b = h.buffer
    rows = grad_recv_x.shape[0]
    with b._together("dispatch_backward", h):
        _check_handle_shape(h, fn, num_tokens, top_k)
        g = _tensor(grad_recv_x, fn, "grad_recv_x", _TORCH_OF[b.dtype], (rows, b.hidden),
                    b.device, align=_epx.PAYLOAD_ALIGNMENT)
        _check_handle_rows(g.shape[0], h, b, fn, "grad_recv_x")
        if x is not None:
            x = _tensor(x, fn, "x", g.dtype, (num_tokens, b.hidden), b.device,
                        align=_epx.PAYLOAD_ALIGNMENT)
    grad_x = _torch.empty((num_tokens, b.hidden), dtype=g.dtype, device=g.device)
    grad_w = _torch.zeros((num_tokens, top_k), dtype=_F32, device=g.device)
    _on_stream(b, g.device)
    b._dispatch_backward(h, _ptr(g), _ptr(grad_x), _ptr(x), _ptr(grad_w) if x is not None
                         else None)
    return grad_x, grad_w


@_dispatch_backward_op.register_fake
def _dispatch_backward_fake(grad_recv_x, x, token, num_tokens, top_k):
    return (grad_recv_x.new_empty((num_tokens, grad_recv_x.shape[1])),
            grad_recv_x.new_empty((num_tokens, top_k), dtype=_F32))


@_torch.library.custom_op("epx::weights_backward", mutates_args=())
@_ranged("epx::weights_backward")
def _weights_backward_op(grad_recv_w: Tensor, token: Tensor, num_tokens: int,
                         top_k: int) -> Tensor:
    """The gradient of recv_w (weights the expert applied) -> grad_w [T, K]."""
    fn = "epx.torch.dispatch (weights backward)"
    h = _handle_of(token, fn)
    b = h.buffer
    with b._together("weights_backward", h):
        _check_handle_shape(h, fn, num_tokens, top_k)
        rows = grad_recv_w.shape[0] if grad_recv_w.dim() else 0
        g = _tensor(grad_recv_w, fn, "grad_recv_w", _F32, _recv_w_shape(b, rows, top_k),
                    b.device)
        _check_handle_rows(g.shape[0], h, b, fn, "grad_recv_w")
    grad_w = _torch.empty((num_tokens, top_k), dtype=_F32, device=g.device)
    _on_stream(b, g.device)
    _epx._check(lib.epx_weights_backward(b._handle_ptr(fn), h._use(b, fn), _ptr(g),
                                         _ptr(grad_w)))
    return grad_w


@_weights_backward_op.register_fake
def _weights_backward_fake(grad_recv_w, token, num_tokens, top_k):
    return grad_recv_w.new_empty((num_tokens, top_k), dtype=_F32)


def _dispatch_setup(ctx, inputs, output):
    x, topk_idx, topk_w, locations, buffer_id, weighting, recorder_id = inputs
    ctx.set_materialize_grads(False)
    ctx.w_grad = topk_w is not None and topk_w.requires_grad
    ctx.w_in_dispatch = ctx.w_grad and weighting == Weighting.IN_DISPATCH
    ctx.num_tokens, ctx.top_k = topk_idx.shape
    ctx.save_for_backward(output[6], x if ctx.w_in_dispatch else None)


def _dispatch_backward(ctx, g_recv_x, g_recv_w, *unused):
    token, x = ctx.saved_tensors
    grad_x = grad_w = None
    if g_recv_x is not None:
        grad_x, gw = _torch.ops.epx.dispatch_backward(g_recv_x.contiguous(), x, token,
                                                      ctx.num_tokens, ctx.top_k)
        grad_w = gw if ctx.w_in_dispatch else None
    if g_recv_w is not None and ctx.w_grad:
        gw = _torch.ops.epx.weights_backward(g_recv_w.contiguous(), token, ctx.num_tokens,
                                             ctx.top_k)
        grad_w = gw if grad_w is None else grad_w + gw
    return grad_x, None, grad_w, None, None, None, None


_dispatch_op.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)


# ---------------------------------------------------------------------------
# FP8 dispatch: epx::dispatch_fp8 (e4m3 rows with their scales)
# ---------------------------------------------------------------------------

_FP8 = getattr(_torch, "float8_e4m3fn", None)
_SCALE_DTYPE = {_epx.FP8Format.E4M3_F32_128: _F32, _epx.FP8Format.E4M3_UE8M0_128: _I32,
                _epx.FP8Format.MXFP8: _torch.uint8}


def _fp8_format(b, fn):
    fmt = _epx.FP8Format(b.config.fp8_format)
    if fmt == _epx.FP8Format.NONE or _FP8 is None:
        _epx._invalid("%s: the buffer has no fp8 format (config.fp8_format is NONE)%s; create it "
                      "with fp8_format=epx.FP8Format...", fn,
                      "" if _FP8 is not None else " or this torch has no float8_e4m3fn")
    cols, _ = _epx.fp8_scale_shape(fmt, b.hidden)
    return fmt, cols


def _fp8_recv(b, fmt, cols, rows, make):
    """An fp8 dispatch's outputs, recv_x_q [rows, H] and recv_scales [rows,
    cols] in the format's scale dtype, made by make(shape, dtype): zeros on
    the device, or a fake op's new_empty."""
    return make((rows, b.hidden), _FP8), make((rows, cols), _SCALE_DTYPE[fmt])


@_torch.library.custom_op("epx::dispatch_fp8", mutates_args=())
@_ranged("epx::dispatch_fp8")
def _dispatch_fp8_op(x: Tensor, x_scales: Optional[Tensor], topk_idx: Tensor,
                     topk_w: Optional[Tensor], locations: Optional[Tensor], buffer_id: int,
                     weighting: int, recorder_id: int
                     ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x_q with x_scales (epx_dispatch_fp8), or x of the buffer's dtype
    quantized on the way when x_scales is None (epx_dispatch_quantize)."""
    fn = "epx.torch.dispatch"
    b = _buffer(buffer_id, fn)
    with b._together("layout"):
        fmt, cols = _fp8_format(b, fn)
        quantize = x_scales is None
        xc, idx, w, loc = _dispatch_inputs(b, x if quantize else x.view(_torch.uint8), topk_idx,
                                           topk_w, locations, fn, _TORCH_OF[b.dtype] if quantize
                                           else _torch.uint8)
        T, K = idx.shape
        sc = None if quantize else _tensor(x_scales, fn, "x_scales", _SCALE_DTYPE[fmt], (T, cols),
                                           b.device)
        rec = _recorder(recorder_id, fn)
    _on_stream(b, x.device)
    handle = b._layout(T, K, _ptr(idx), _ptr(w), _ptr(loc), weighting, rec)
    token = _token(handle)
    rows = _max_rows(b, fn)
    recv_q, recv_s = _fp8_recv(b, fmt, cols, rows,
                               lambda dims, dtype: _torch.zeros(dims, dtype=dtype, device=x.device))
    b._dispatch_fp8(handle, _ptr(xc), _ptr(sc), _ptr(recv_q), _ptr(recv_s), rows)
    return (recv_q, recv_s) + _recv_metadata(b, handle, rows, K, x.device, fn) + (token,)


@_dispatch_fp8_op.register_fake
def _dispatch_fp8_fake(x, x_scales, topk_idx, topk_w, locations, buffer_id, weighting,
                       recorder_id):
    fn = "epx.torch.dispatch"
    b = _buffer(buffer_id, fn)
    _sized_buffer(b, fn)
    fmt, cols = _fp8_format(b, fn)
    rows = _max_rows(b, fn)
    shape = _recv_w_shape(b, rows, topk_idx.shape[1])
    n = b.experts_per_rank
    recv = _fp8_recv(b, fmt, cols, rows, lambda dims, dtype: x.new_empty(dims, dtype=dtype))
    return recv + (x.new_empty(shape, dtype=_F32), x.new_empty(shape, dtype=_I32),
                   x.new_empty((n,), dtype=_I64), x.new_empty((n + 1,), dtype=_I64),
                   x.new_empty((1,), dtype=_I64), _torch.empty((1,), dtype=_I64, device="cpu"))


def _dispatch_fp8_setup(ctx, inputs, output):
    topk_idx, topk_w = inputs[2], inputs[3]
    ctx.set_materialize_grads(False)
    ctx.w_grad = topk_w is not None and topk_w.requires_grad
    ctx.num_tokens, ctx.top_k = topk_idx.shape
    ctx.save_for_backward(output[7])


def _dispatch_fp8_backward(ctx, g_q, g_s, g_recv_w, *unused):
    """fp8 rows carry no gradient; recv_w's reaches topk_w as in dispatch."""
    token, = ctx.saved_tensors
    grad_w = None
    if g_recv_w is not None and ctx.w_grad:
        grad_w = _torch.ops.epx.weights_backward(g_recv_w.contiguous(), token, ctx.num_tokens,
                                                 ctx.top_k)
    return None, None, None, grad_w, None, None, None, None


_dispatch_fp8_op.register_autograd(_dispatch_fp8_backward, setup_context=_dispatch_fp8_setup)


def dequantize(recv_x, recv_scales, fp8_format, dtype=_torch.bfloat16):
    """fp8 rows [N, H] (float8_e4m3fn) and their scales -> [N, H] of dtype:
    float32(e4m3) * scale rounded once, the bits of epx_dequantize and of
    DeepEP's per_token_cast_back (a UE8M0 byte is its exponent: 255 is
    infinite; an MXFP8 E8M0 byte 255 is NaN, 0 is 2^-127)."""
    fmt = _epx.FP8Format(fp8_format)
    n, h = recv_x.shape
    if fmt == _epx.FP8Format.E4M3_F32_128:
        scale = recv_scales.float()
    else:
        b = recv_scales.contiguous().view(_torch.uint8).view(n, -1).to(_I32)
        if fmt == _epx.FP8Format.MXFP8:
            b = _torch.where(b == 255, _torch.full_like(b, 0x7FFFFFFF),
                             _torch.where(b == 0, _torch.full_like(b, 0x00400000), b << 23))
        else:
            b = b << 23
        scale = b.view(_F32)
    block = h // scale.shape[1]
    return (recv_x.float().view(n, -1, block) * scale.unsqueeze(2)).view(n, h).to(dtype)


class _Fp8StraightThrough(_torch.autograd.Function):
    """Quantize-on-dispatch whose experts see the dequantized rows, with the
    gradient of a dispatch of those rows (straight through the quantizer:
    epx_dispatch_backward of the rows' gradient, in the buffer's dtype), and
    recv_w's gradient to topk_w as in dispatch."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_w, locations, buffer_id, weighting, recorder_id):
        outs = _torch.ops.epx.dispatch_fp8(x, None, topk_idx, topk_w, locations, buffer_id,
                                           weighting, recorder_id)
        recv_q, recv_s, recv_w, recv_expert, counts, offsets, rows, token = outs
        fmt = _buffer(buffer_id, "epx.torch.MoE").config.fp8_format
        ctx.num_tokens, ctx.top_k = topk_idx.shape
        ctx.w_grad = topk_w is not None and topk_w.requires_grad
        ctx.save_for_backward(token)
        ctx.mark_non_differentiable(recv_expert, counts, offsets, rows, token)
        return (dequantize(recv_q, recv_s, fmt, x.dtype), recv_w, recv_expert, counts, offsets, rows,
                token)

    @staticmethod
    def backward(ctx, g_recv_x, g_recv_w, *unused):
        token, = ctx.saved_tensors
        grad_x = grad_w = None
        if g_recv_x is not None:
            grad_x, _ = _torch.ops.epx.dispatch_backward(g_recv_x.contiguous(), None, token,
                                                         ctx.num_tokens, ctx.top_k)
        if g_recv_w is not None and ctx.w_grad:
            grad_w = _torch.ops.epx.weights_backward(g_recv_w.contiguous(), token, ctx.num_tokens,
                                                     ctx.top_k)
        return grad_x, None, grad_w, None, None, None, None


# ---------------------------------------------------------------------------
# Combine: epx::combine and its backward
# ---------------------------------------------------------------------------


@_torch.library.custom_op("epx::combine", mutates_args=())
@_ranged("epx::combine")
def _combine_op(expert_out: Tensor, topk_w: Optional[Tensor], token: Tensor, num_tokens: int,
                weighting: int) -> Tensor:
    """expert_out [rows >= N, H] -> out [T, H]. topk_w is only the autograd
    input through which combine's backward returns the weights' gradient
    (the handle has its own copy of the weights)."""
    fn = "epx.torch.combine"
    h = _handle_of(token, fn)
    b = h.buffer
    with b._together("combine", h):
        _check_handle_shape(h, fn, num_tokens)
        rows = expert_out.shape[0] if isinstance(expert_out, Tensor) and expert_out.dim() else 0
        e = _tensor(expert_out, fn, "expert_out", _TORCH_OF[b.dtype], (rows, b.hidden),
                    b.device, align=_epx.PAYLOAD_ALIGNMENT)
        _check_handle_rows(e.shape[0], h, b, fn, "expert_out")
    out = _torch.empty((num_tokens, b.hidden), dtype=e.dtype, device=e.device)
    _on_stream(b, e.device)
    b._combine(h, _ptr(e), _ptr(out))
    return out


@_combine_op.register_fake
def _combine_fake(expert_out, topk_w, token, num_tokens, weighting):
    return expert_out.new_empty((num_tokens, expert_out.shape[1]))


@_torch.library.custom_op("epx::combine_backward", mutates_args=())
@_ranged("epx::combine_backward")
def _combine_backward_op(grad_out: Tensor, expert_out: Optional[Tensor], token: Tensor,
                         rows: int, top_k: int) -> Tuple[Tensor, Tensor]:
    """grad_out -> (grad_expert_out [rows, H], zeros past the valid rows;
    grad_w [T, K], computed when expert_out, the forward's input, is given)."""
    fn = "epx.torch.combine (backward)"
    h = _handle_of(token, fn)
    b = h.buffer
    T = grad_out.shape[0]
    with b._together("combine_backward", h):
        _check_handle_shape(h, fn, T)
        g = _tensor(grad_out, fn, "grad_out", _TORCH_OF[b.dtype], (T, b.hidden), b.device,
                    align=_epx.PAYLOAD_ALIGNMENT)
        _check_handle_rows(rows, h, b, fn, "grad_expert_out")
        if expert_out is not None:
            expert_out = _tensor(expert_out, fn, "expert_out", g.dtype, (rows, b.hidden),
                                 b.device, align=_epx.PAYLOAD_ALIGNMENT)
    grad_e = _torch.zeros((rows, b.hidden), dtype=g.dtype, device=g.device)
    grad_w = _torch.zeros((T, top_k), dtype=_F32, device=g.device)
    _on_stream(b, g.device)
    b._combine_backward(h, _ptr(g), _ptr(expert_out), _ptr(grad_e),
                        _ptr(grad_w) if expert_out is not None else None)
    return grad_e, grad_w


@_combine_backward_op.register_fake
def _combine_backward_fake(grad_out, expert_out, token, rows, top_k):
    return (grad_out.new_empty((rows, grad_out.shape[1])),
            grad_out.new_empty((grad_out.shape[0], top_k), dtype=_F32))


def _combine_setup(ctx, inputs, output):
    expert_out, topk_w, token, num_tokens, weighting = inputs
    ctx.set_materialize_grads(False)
    ctx.w_grad = (topk_w is not None and topk_w.requires_grad
                  and weighting == Weighting.IN_COMBINE)
    ctx.rows = expert_out.shape[0]
    ctx.top_k = topk_w.shape[1] if topk_w is not None else 1
    ctx.save_for_backward(token, expert_out if ctx.w_grad else None)


def _combine_backward(ctx, grad_out):
    token, expert_out = ctx.saved_tensors
    if grad_out is None:
        return None, None, None, None, None
    grad_e, grad_w = _torch.ops.epx.combine_backward(grad_out.contiguous(), expert_out, token,
                                                     ctx.rows, ctx.top_k)
    return grad_e, grad_w if ctx.w_grad else None, None, None, None


_combine_op.register_autograd(_combine_backward, setup_context=_combine_setup)


# ---------------------------------------------------------------------------
# Exact-size dispatch (epx::dispatch_exact) and dispatch again on a handle
# (epx::dispatch_cached)
# ---------------------------------------------------------------------------


@_torch.library.custom_op("epx::dispatch_exact", mutates_args=())
@_ranged("epx::dispatch_exact")
def _dispatch_exact_op(x: Tensor, topk_idx: Tensor, topk_w: Optional[Tensor],
                       locations: Optional[Tensor], buffer_id: int, weighting: int,
                       recorder_id: int
                       ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """epx::dispatch with receive tensors of exactly N rows: the layout's row
    count is read on the host (one host sync on CUDA) before they are made."""
    fn = "epx.torch.dispatch"
    b = _buffer(buffer_id, fn)
    with b._together("layout"):
        xc, idx, w, loc = _dispatch_inputs(b, x, topk_idx, topk_w, locations, fn)
        rec = _recorder(recorder_id, fn)
    T, K = idx.shape
    _on_stream(b, x.device)
    handle = b._layout(T, K, _ptr(idx), _ptr(w), _ptr(loc), weighting, rec)
    token = _token(handle)
    rows = handle.recv_rows
    recv_x = _torch.zeros((rows, b.hidden), dtype=xc.dtype, device=x.device)
    b._dispatch(handle, _ptr(xc), _ptr(recv_x), rows)
    return (recv_x,) + _recv_metadata(b, handle, rows, K, x.device, fn) + (token,)


@_dispatch_exact_op.register_fake
def _dispatch_exact_fake(x, topk_idx, topk_w, locations, buffer_id, weighting, recorder_id):
    b = _buffer(buffer_id, "epx.torch.dispatch")
    rows = _torch.library.get_ctx().new_dynamic_size()
    shape = _recv_w_shape(b, rows, topk_idx.shape[1])
    n = b.experts_per_rank
    return (x.new_empty((rows, b.hidden)), x.new_empty(shape, dtype=_F32),
            x.new_empty(shape, dtype=_I32), x.new_empty((n,), dtype=_I64),
            x.new_empty((n + 1,), dtype=_I64), x.new_empty((1,), dtype=_I64),
            _torch.empty((1,), dtype=_I64, device="cpu"))


_dispatch_exact_op.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)


@_torch.library.custom_op("epx::dispatch_cached", mutates_args=())
@_ranged("epx::dispatch_cached")
def _dispatch_cached_op(x: Tensor, token: Tensor, rows: int, top_k: int) -> Tensor:
    """x [T, H] -> recv_x [rows, H] along an earlier dispatch's layout
    (epx_dispatch on its handle: no layout, no count exchange)."""
    fn = "epx.torch.dispatch (on a handle)"
    h = _handle_of(token, fn)
    b = h.buffer
    with b._together("dispatch", h):
        _check_handle_shape(h, fn, h.num_tokens, top_k)
        xc = _tensor(x, fn, "x", _TORCH_OF[b.dtype], (h.num_tokens, b.hidden), b.device,
                     align=_epx.PAYLOAD_ALIGNMENT)
        _check_handle_rows(rows, h, b, fn, "recv_x")
    recv_x = _torch.zeros((rows, b.hidden), dtype=xc.dtype, device=x.device)
    _on_stream(b, x.device)
    b._dispatch(h, _ptr(xc), _ptr(recv_x), rows)
    return recv_x


@_dispatch_cached_op.register_fake
def _dispatch_cached_fake(x, token, rows, top_k):
    return x.new_empty((rows, x.shape[1]))


def _dispatch_cached_setup(ctx, inputs, output):
    x, token, rows, top_k = inputs
    ctx.num_tokens, ctx.top_k = x.shape[0], top_k
    ctx.save_for_backward(token)


def _dispatch_cached_backward(ctx, g_recv_x):
    token, = ctx.saved_tensors
    grad_x, _ = _torch.ops.epx.dispatch_backward(g_recv_x.contiguous(), None, token,
                                                 ctx.num_tokens, ctx.top_k)
    return grad_x, None, None, None


_dispatch_cached_op.register_autograd(_dispatch_cached_backward,
                                      setup_context=_dispatch_cached_setup)


@_torch.library.custom_op("epx::dispatch_fp8_cached", mutates_args=())
@_ranged("epx::dispatch_fp8_cached")
def _dispatch_fp8_cached_op(x: Tensor, x_scales: Optional[Tensor], token: Tensor, rows: int,
                            top_k: int, buffer_id: int) -> Tuple[Tensor, Tensor]:
    """x_q with x_scales (epx_dispatch_fp8), or x of the buffer's dtype
    quantized on the way when x_scales is None (epx_dispatch_quantize),
    along an earlier dispatch's layout: (recv_x_q [rows, H], recv_scales
    [rows, scale_cols])."""
    fn = "epx.torch.dispatch (on a handle)"
    h = _handle_of(token, fn)
    b = h.buffer
    with b._together("dispatch", h):
        _check_handle_shape(h, fn, h.num_tokens, top_k)
        fmt, cols = _fp8_format(b, fn)
        quantize = x_scales is None
        xc = _tensor(x if quantize else x.view(_torch.uint8), fn, "x",
                     _TORCH_OF[b.dtype] if quantize else _torch.uint8, (h.num_tokens, b.hidden),
                     b.device, align=_epx.PAYLOAD_ALIGNMENT)
        sc = None if quantize else _tensor(x_scales, fn, "x_scales", _SCALE_DTYPE[fmt],
                                           (h.num_tokens, cols), b.device)
        _check_handle_rows(rows, h, b, fn, "recv_x")
    recv_q, recv_s = _fp8_recv(b, fmt, cols, rows,
                               lambda dims, dtype: _torch.zeros(dims, dtype=dtype, device=x.device))
    _on_stream(b, x.device)
    b._dispatch_fp8(h, _ptr(xc), _ptr(sc), _ptr(recv_q), _ptr(recv_s), rows)
    return recv_q, recv_s


@_dispatch_fp8_cached_op.register_fake
def _dispatch_fp8_cached_fake(x, x_scales, token, rows, top_k, buffer_id):
    b = _buffer(buffer_id, "epx.torch.dispatch (on a handle)")
    fmt, cols = _fp8_format(b, "epx.torch.dispatch (on a handle)")
    return _fp8_recv(b, fmt, cols, rows, lambda dims, dtype: x.new_empty(dims, dtype=dtype))


def _dispatch_fp8_cached_backward(ctx, g_q, g_s):
    """fp8 rows carry no gradient (as a fresh fp8 dispatch's)."""
    return None, None, None, None, None, None


_dispatch_fp8_cached_op.register_autograd(_dispatch_fp8_cached_backward)


# ---------------------------------------------------------------------------
# The functional API
# ---------------------------------------------------------------------------


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
        _epx._check(lib.epx_handle_recv_source(h._use(b, fn), _ptr(rank), _ptr(token)))
        return rank, token

    def recv_rows_host(self):
        """N as a Python int (waits for the device on CUDA)."""
        return int(self.recv_rows[0])

    def counts_host(self):
        """Rows per local expert as a list of ints (waits for the device on CUDA)."""
        return [int(c) for c in self.counts.tolist()]


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
            _epx._invalid("%s: x_scales is given with quantize=True; quantizing makes the scales "
                          "(pass x of the buffer's dtype)", fn)
        if not quantize and x_scales is None:
            _epx._invalid("%s: x is float8_e4m3fn but x_scales is None; pass its scales "
                          "(epx.fp8_scale_shape), or x of the buffer's dtype with quantize=True", fn)
        return True
    if x_scales is not None:
        _epx._invalid("%s: x_scales is given but x is %s; pass x as torch.float8_e4m3fn", fn,
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
        _epx._invalid("%s: %s given with handle=; a dispatch on a handle takes only x (with "
                      "x_scales or quantize for fp8 rows; the routing, weights and sizes are the "
                      "handle's)", fn, ", ".join(extra))
    if d.buffer_id != buffer.id:
        _epx._invalid("%s: the handle's dispatch was on buffer %d, not on buffer %d; pass the "
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
            _epx._invalid("%s: x is a tuple of %d%s; pass (x_q, x_scales) as DeepEP takes it, or "
                          "x_q with x_scales=", fn, len(x),
                          " and x_scales is given too" if x_scales is not None else "")
        x, x_scales = x
    _tensor_args(fn, dict(x=x), dict(topk_idx=topk_idx, topk_w=topk_w, locations=locations,
                                     x_scales=x_scales))
    if handle is not None:
        extra = [name for name, v in (("topk_idx", topk_idx), ("topk_w", topk_w),
                                      ("locations", locations),
                                      ("exact_size", exact_size or None)) if v is not None]

        def call():
            return _dispatch_again(buffer, handle, x, x_scales, quantize, extra)
    else:
        if topk_idx is None:
            _epx._invalid("%s: topk_idx is None; pass the routing [T, K], or handle= an earlier "
                          "Dispatched to dispatch again along its layout", fn)
        if exact_size and (quantize or x_scales is not None):
            _epx._refuse(Status.ERROR_UNSUPPORTED, "%s: exact_size with an fp8 dispatch is not "
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
    _tensor_args("epx.torch.combine", dict(expert_out=expert_out), {})
    w = d.topk_w if d.weighting == Weighting.IN_COMBINE else None

    def call():
        return _torch.ops.epx.combine(expert_out, w, d.handle_id, d.num_tokens, d.weighting)
    if previous_event is None and not async_finish and comm_stream is None:
        return (call(), EventOverlap()) if return_event else call()
    out, event = _overlapped("epx.torch.combine", expert_out.device, previous_event, async_finish,
                             comm_stream, (expert_out, w), call)
    return (out, event) if (async_finish if return_event is None else return_event) else out


# ---------------------------------------------------------------------------
# Low-latency decode (a buffer made with low_latency=1; epx.h, "Low-latency
# decode"). Inference only: no autograd (the library refuses backward there).
# ---------------------------------------------------------------------------


def _ll_hook(buffer, handle, send_only):
    return (lambda: buffer.ll_complete(handle)) if send_only else None


def _ll_count(b, num_tokens, rows, fn):
    """(the step's count for the handle, the count's address or None): an
    int, or an int32 tensor of one element on the buffer's device (on CUDA
    read there by the kernels, so a captured graph replays with new counts;
    the handle's count is then the rows)."""
    if num_tokens is None:
        return rows, None
    if isinstance(num_tokens, _torch.Tensor):
        t = _tensor(num_tokens.reshape(1), fn, "num_tokens", _I32, (1,), b.device)
        if b.device == Device.CUDA:
            return rows, t.data_ptr(), t
        num_tokens = int(t)
    step = int(num_tokens)
    if not 0 <= step <= rows:
        _epx._invalid("%s: num_tokens is %d; pass a count in [0, %d] (the rows of x)", fn, step, rows)
    count = ctypes.c_int32(step)
    return step, ctypes.addressof(count), count


def ll_dispatch(buffer, x, topk_idx, topk_w=None, *, num_tokens=None,
                weighting=Weighting.IN_COMBINE, return_recv_hook=False):
    """DeepEP's low_latency_dispatch on a low-latency buffer
    (make_buffer(..., low_latency=1)): x [T, H] -> (recv_x, recv_count,
    handle, hook). recv_x has buffer.ll_shape() ([E_local, W * max_tokens, H]
    expert-major; [W, max_tokens, H] rank-major, with weighting NONE) in the
    buffer's dtype; recv_count [E_local] int32 (rank-major: rows per source
    rank); expert e's rows are recv_x[e, :recv_count[e]], in the normal
    exchange's order. handle (an epx.Handle) drives ll_combine and gives
    recv_source(); release it when done. num_tokens: the step's count when x
    and the routing hold more rows, an int or an int32 tensor of one element
    (on a CUDA buffer read on the device: a captured CUDA graph replays with
    the count of the moment; combine's output then has T rows, zeros past the
    count). return_recv_hook: the send runs now and hook() completes it
    (epx_ll_complete); read recv_x after hook(); else hook is None. CUDA
    tensors run on PyTorch's current stream."""
    fn = "epx.torch.ll_dispatch"
    b = buffer
    dt = torch_dtype(b.dtype)
    if not isinstance(x, _torch.Tensor) or x.dim() != 2:
        _tensor(x, fn, "x", dt, (None, b.hidden), b.device)
    T = x.shape[0]
    x = _tensor(x, fn, "x", dt, (T, b.hidden), b.device, align=16)
    idx = _routing_tensor(topk_idx, fn, "topk_idx", _I32, (T, None), b.device, high=b.num_experts)
    K = idx.shape[1]
    w = _routing_tensor(topk_w, fn, "topk_w", _F32, (T, K), b.device,
                        optional=weighting == Weighting.NONE)
    step, count_address, *keep = _ll_count(b, num_tokens, T, fn)
    _on_stream(b, x.device)
    shape = b.ll_shape()
    recv_x = _torch.empty(shape, dtype=dt, device=x.device)
    recv_count = _torch.empty((shape[0],), dtype=_I32, device=x.device)
    h = b._ll_dispatch(step, K, _ptr(idx), _ptr(w), weighting, count_address, _ptr(x),
                       recv_x.data_ptr(), recv_count.data_ptr(), return_recv_hook, rows=T)
    return recv_x, recv_count, h, _ll_hook(b, h, return_recv_hook)


def ll_combine(buffer, x, handle, *, out=None, return_recv_hook=False):
    """DeepEP's low_latency_combine: x (the expert outputs, buffer.ll_shape())
    -> (combined [T, H], hook): each token's weighted sum, the bits of the
    normal combine on the same routing. return_recv_hook as in ll_dispatch."""
    fn = "epx.torch.ll_combine"
    b = buffer
    dt = torch_dtype(b.dtype)
    x = _tensor(x, fn, "x", dt, b.ll_shape(), b.device, align=16)
    T = handle.num_tokens
    if out is None:
        out = _torch.empty((T, b.hidden), dtype=dt, device=x.device)
    elif _tensor(out, fn, "out", dt, (T, b.hidden), b.device, align=16).data_ptr() != out.data_ptr():
        _epx._invalid("%s: out must be contiguous and 16-byte aligned (it is written in place)", fn)
    _on_stream(b, x.device)
    call = lib.epx_ll_combine_send if return_recv_hook else lib.epx_ll_combine
    _epx._check(call(b._handle_ptr(fn), handle._use(b, fn), _ptr(x), _ptr(out)))
    return out, _ll_hook(b, handle, return_recv_hook)


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


# ---------------------------------------------------------------------------
# Grouped matmul over expert-major groups
# ---------------------------------------------------------------------------


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


def _grouped_mm_loop_setup(ctx, inputs, output):
    x, w, ends = inputs
    ctx.save_for_backward(x, w, ends)


def _grouped_mm_loop_backward(ctx, grad_out):
    x, w, ends = ctx.saved_tensors
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = _torch.ops.epx.grouped_mm_loop(grad_out, w.transpose(-2, -1), ends)
    if ctx.needs_input_grad[1]:
        grad_w = _torch.ops.epx.grouped_mm_weight_grad(x, grad_out, ends).to(w.dtype)
    return grad_x, grad_w, None


_grouped_mm_loop_op.register_autograd(_grouped_mm_loop_backward,
                                      setup_context=_grouped_mm_loop_setup)


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


# ---------------------------------------------------------------------------
# The MoE layer
# ---------------------------------------------------------------------------


_MOE_FIXED = ("num_experts", "top_k", "capacity_mode", "device", "stream", "token_mask",
              "aux_loss_expert_counts")


def _moe_route_config(num_experts, top_k, capacity_factor, on_gpu, route_config, options):
    """The MoE router's RouteConfig: route_config (or the defaults) with
    the keyword routing options set; capacity mode when capacity_factor is
    given (into capacity_factor_f64 under CapacityArithmetic.FLOAT64)."""
    fn = "epx.torch.MoE"
    for name in _MOE_FIXED:
        if name in options:
            _epx._invalid("%s: %s is not a routing option of the layer (%s)", fn, name,
                          "set by the layer" if name in _MOE_FIXED[:4] else
                          "memory: pass it to forward()" if name != "stream" else
                          "the current torch stream is used")
    if route_config is not None and not isinstance(route_config, _epx.RouteConfig):
        raise TypeError("%s: route_config is a %s; pass an epx.RouteConfig"
                        % (fn, type(route_config).__name__))
    config = route_config.copy() if route_config is not None else _epx.RouteConfig()
    if route_config is None and "nonfinite" not in options:
        # refusing NaN logits costs a host wait per route on CUDA
        options = dict(options, nonfinite=_epx.Nonfinite.DROP if on_gpu else _epx.Nonfinite.ERROR)
    options = {k: int(v) if isinstance(v, bool) else v for k, v in options.items()}
    config = config.copy(num_experts=num_experts, top_k=top_k, device=Device.CPU, stream=None,
                         token_mask=None, aux_loss_expert_counts=None, **options)
    if capacity_factor is not None:
        field = ("capacity_factor_f64"
                 if config.capacity_arithmetic == _epx.CapacityArithmetic.FLOAT64
                 else "capacity_factor")
        config = config.copy(capacity_mode=1, **{field: capacity_factor})
    _route_capacity(config, 0)  # a bad config is refused here, not at the first forward
    return config


class MoE(_torch.nn.Module):
    """A Mixture-of-Experts layer over an epx comm: a float32 router (epx_route
    with the library's routing options), this rank's E/W SwiGLU experts
    through grouped matmuls, dispatch and combine. forward(x [..., H],
    token_mask=None, aux_loss_expert_counts=None) -> [..., H];
    ``self.aux_loss`` is the step's aux + z loss (add it to the loss so the
    router learns balance).

    Parameters: router.weight [E, H] float32 (replicated: all-reduce its
    gradient over data parallel ranks as usual), w_gate_up [E_local, 2F, H]
    (gate rows first, then up) and w_down [E_local, H, F] in `dtype`, laid
    out [out, in] like nn.Linear (this rank's experts, global ids
    rank*E_local ...), and expert_bias [E] (selection only, no gradient) when
    expert_bias=True. expert_alignment pads each expert's group of rows
    (default 8 on CUDA, as grouped GEMM kernels like, 1 on CPU).

    weighting: where the routing weights are applied (IN_COMBINE default;
    IN_DISPATCH; NONE: the experts scale their activations by recv_w) — the
    router gets its gradient in every one. layout EXPERT_MAJOR (dropless,
    or capacity routing with drops) or CAPACITY ([E_local, W*C, H], needs
    capacity_factor). max_tokens_per_rank: the most tokens a forward gets
    (needed: it sizes every receive tensor). exact_size: the experts get
    exactly the N received rows instead of the worst case (one host sync per
    forward; see :func:`dispatch` for the memory of each mode). generator: a
    CPU torch.Generator for the initial weights (each rank keeps its own
    experts' draws, so global expert e starts the same whatever the rank
    count).

    The router: every field of epx.RouteConfig is a keyword argument
    (score_fn, num_groups, topk_groups, group_score_experts, renormalize,
    renormalize_after_drop, scaling_factor, min_capacity, queue_order,
    drop_policy, random_seed, capacity_arithmetic, aux_counts,
    aux_loss_coeff, z_loss_coeff, aux_loss_sequences, aux_loss_tokens,
    nonfinite), or pass a whole ``route_config`` (the keywords override
    it). capacity_factor turns capacity mode on (a double under
    CapacityArithmetic.FLOAT64). nonfinite defaults to DROP on CUDA (ERROR
    costs a host wait per step and cannot be captured in a CUDA graph); a
    route_config keeps its own nonfinite (epx.RouteConfig() has ERROR: on
    CUDA set nonfinite=DROP there or as a keyword). The two memory fields are forward's
    arguments: token_mask [...] (bool, True = a real token; padding routes
    nowhere and counts in no loss) and aux_loss_expert_counts [E] (the
    global aux loss's counts, e.g. summed over ranks).

    ``self.aux_loss`` keeps the last forward's autograd graph alive until
    the next forward; with it, the parameters' gradient accumulators, whose
    CUDA stream is the one they were made on. Before a CUDA-graph warm-up
    on a side stream, after eager steps, set ``layer.aux_loss = None`` (or
    the capture fails: the accumulators would sync with the default
    stream).

    fp8=True (DeepEP's e4m3 with float32 scales per 128) or an
    epx.FP8Format: the tokens are quantized on the way (epx_dispatch_quantize,
    half the bytes of a bf16 dispatch) and the experts run on the
    dequantized rows (:func:`dequantize`; PyTorch's scaled grouped GEMM
    takes per-row scales on sm_90, none per block of 128 or 32, so the
    GEMMs are in the layer's dtype: ``self.fp8_gemm`` says which ran,
    "dequantized"); the backward is a dispatch's of those rows (straight
    through the quantizer) and combine stays in the layer's dtype."""

    def __init__(self, comm, hidden_size, ffn_hidden_size, num_experts, top_k, *,
                 max_tokens_per_rank, dtype=_F32, device="cpu", weighting=Weighting.IN_COMBINE,
                 exchange=Exchange.DEDUP, layout=Layout.EXPERT_MAJOR, expert_alignment=None,
                 combine_precision=0, capacity_factor=None, expert_bias=False, generator=None,
                 exact_size=False, route_config=None, fp8=None, **route_options):
        super().__init__()
        self.exact_size = bool(exact_size)
        self.fp8 = _epx.FP8Format(_epx.FP8Format.E4M3_F32_128 if fp8 is True else int(fp8 or 0))
        if self.fp8 and (self.exact_size or Weighting(weighting) == Weighting.IN_DISPATCH):
            _epx._invalid("epx.torch.MoE: fp8 dispatch with %s is not offered; use exact_size=False "
                          "and weights in combine or NONE", "exact_size" if self.exact_size
                          else "Weighting.IN_DISPATCH (fp8 rows are not scaled on the way)")
        W = comm.size
        if num_experts % W:
            _epx._invalid("epx.torch.MoE: num_experts %d is not a multiple of the comm's %d "
                          "ranks", num_experts, W)
        if Layout(layout) == Layout.RANK_MAJOR:
            _epx._refuse(Status.ERROR_UNSUPPORTED, "epx.torch.MoE: the rank-major layout has no "
                         "expert groups for a grouped matmul; use EXPERT_MAJOR or CAPACITY (or "
                         "epx.torch.dispatch with your own experts)")
        on_gpu = _torch.device(device).type == "cuda"
        self.route_config = _moe_route_config(num_experts, top_k, capacity_factor, on_gpu,
                                              route_config, route_options)
        if Layout(layout) == Layout.CAPACITY and not self.route_config.capacity_mode:
            _epx._invalid("epx.torch.MoE: layout CAPACITY needs capacity_factor")
        if expert_alignment is None:
            expert_alignment = 8 if on_gpu else 1
        self.comm, self.hidden_size, self.ffn_hidden_size = comm, hidden_size, ffn_hidden_size
        self.num_experts, self.top_k = num_experts, top_k
        self.num_local_experts = num_experts // W
        self.weighting, self.layout = Weighting(weighting), Layout(layout)
        capacity = (_epx.route_capacity(max_tokens_per_rank, self.route_config)
                    if self.layout == Layout.CAPACITY else 0)
        self.buffer = make_buffer(comm, hidden=hidden_size, num_experts=num_experts,
                                  max_top_k=top_k, max_tokens_per_rank=max_tokens_per_rank,
                                  dtype=dtype, device=device, exchange=exchange, layout=layout,
                                  expert_alignment=expert_alignment, capacity=capacity,
                                  combine_precision=combine_precision, fp8_format=self.fp8)
        self._buffer_id = self.buffer.id
        self._config_id = _config_id(self.route_config)
        # the GEMMs the experts run on fp8 rows (the class docstring says why)
        self.fp8_gemm = "dequantized" if self.fp8 else None
        self._init_parameters(device, dtype, generator, expert_bias)
        self.aux_loss = None

    def _init_parameters(self, device, dtype, g, expert_bias):
        """Random weights scaled by 1/sqrt(fan-in). From `g` (a CPU
        generator) when given: the router, then every global expert's
        gate/up, then every expert's down weights, in expert order, each rank
        keeping its own experts', so global expert e has the same weights
        whatever the rank count (every rank draws all E, one expert at a
        time). Ranks that are threads of one process (epx.run_local) would
        share torch's global generator, in a racy order: without `g` they
        draw as from a generator seeded with torch.initial_seed(). Else from
        the device's default generator directly in `dtype` (no float32 copy
        on the host: a DeepSeek-sized layer's experts are tens of GB)."""
        dtype = torch_dtype(dtype)
        El, H, F, E = self.num_local_experts, self.hidden_size, self.ffn_hidden_size, \
            self.num_experts
        if g is None and getattr(self.comm, "_world", None) is not None:
            g = _torch.Generator().manual_seed(_torch.initial_seed())
        first = self.comm.rank * El

        def draw(*shape, fan_in, dt):
            if g is None:
                return _torch.randn(*shape, device=device, dtype=dt).mul_(1.0 / math.sqrt(fan_in))
            return (_torch.randn(*shape, generator=g) / math.sqrt(fan_in)).to(device=device,
                                                                           dtype=dt)

        def draw_experts(*shape, fan_in):
            if g is None:
                return draw(El, *shape, fan_in=fan_in, dt=dtype)
            mine = [w for e, w in ((e, draw(*shape, fan_in=fan_in, dt=dtype)) for e in range(E))
                    if first <= e < first + El]
            return _torch.stack(mine)
        self.router = _torch.nn.Linear(H, E, bias=False, device=device)
        with _torch.no_grad():
            self.router.weight.copy_(draw(E, H, fan_in=H, dt=_F32))
        self.w_gate_up = _torch.nn.Parameter(draw_experts(2 * F, H, fan_in=H))
        self.w_down = _torch.nn.Parameter(draw_experts(H, F, fan_in=F))
        self.register_buffer("expert_bias", _torch.zeros(E, device=device)
                             if expert_bias else None)

    def experts(self, d):
        """SwiGLU over the expert-major groups of a :class:`Dispatched`:
        [N_max, H] -> [N_max, H]."""
        ends = d.offsets[1:].to(_I32)
        h = grouped_mm(d.recv_x, self.w_gate_up.transpose(-2, -1), ends)
        gate, up = h.chunk(2, dim=-1)
        act = _F.silu(gate) * up
        if self.weighting == Weighting.NONE:
            act = act * d.recv_w.unsqueeze(-1).to(act.dtype)
        return grouped_mm(act, self.w_down.transpose(-2, -1), ends)

    def _check_input(self, x):
        fn = "epx.torch.MoE.forward"
        if not isinstance(x, Tensor):
            raise TypeError("%s: x is a %s; pass a tensor [..., %d]"
                            % (fn, type(x).__name__, self.hidden_size))
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            _epx._invalid("%s: x has shape %s but the layer's hidden size is %d; pass x "
                          "[..., %d]", fn, tuple(x.shape), self.hidden_size, self.hidden_size)
        want = self.w_gate_up.dtype
        if x.dtype != want:
            _epx._invalid("%s: x is %s but the layer's experts are %s; pass x.to(%s)", fn,
                          x.dtype, want, want)
        if x.device != self.w_gate_up.device:
            _epx._invalid("%s: x is on %s but the layer is on %s; move one of them", fn,
                          x.device, self.w_gate_up.device)

    def forward(self, x, token_mask=None, aux_loss_expert_counts=None, return_counts=False):
        """x [..., H] -> out [..., H]; with return_counts, (out, expert_counts)
        where expert_counts [E] int32 are the tokens this rank routed to each
        expert (DeepSpeed's exp_counts; on the device, no host wait). Also
        kept: ``self.expert_counts`` and ``self.tokens_per_expert`` ([E_local]
        int64 rows this rank's experts received)."""
        self._check_input(x)
        shape = x.shape
        x2 = x.reshape(-1, self.hidden_size)
        logits = _F.linear(x2.float(), self.router.weight.float())
        dev = Device.CUDA if x.is_cuda else Device.CPU
        if token_mask is not None:
            token_mask = token_mask.reshape(-1)
        mask, counts = _route_tensors("epx.torch.MoE.forward", x2.shape[0], self.num_experts, dev,
                                      token_mask, aux_loss_expert_counts)
        outs = _torch.ops.epx.route(logits, self.expert_bias, mask, counts, self._config_id)
        idx, w, loc, expert_counts, aux, z, _ = outs
        self.aux_loss = aux + z
        self.expert_counts = expert_counts
        locations = loc if self.layout == Layout.CAPACITY else None
        if self.fp8:
            outs = _Fp8StraightThrough.apply(x2, idx, w, locations, self._buffer_id,
                                             int(self.weighting), RECORDER_AMBIENT)
        else:
            op = _torch.ops.epx.dispatch_exact if self.exact_size else _torch.ops.epx.dispatch
            outs = op(x2, idx, w, locations, self._buffer_id, int(self.weighting), RECORDER_AMBIENT)
        d = Dispatched(*outs, w, x2.shape[0], self.top_k, int(self.weighting), self._buffer_id)
        self.tokens_per_expert = d.counts
        out = combine(d, self.experts(d)).reshape(shape)
        return (out, expert_counts) if return_counts else out


# ---------------------------------------------------------------------------
# A token dispatcher shaped like Megatron-core's MoEAlltoAllTokenDispatcher
# ---------------------------------------------------------------------------


class TokenDispatcher:
    """Megatron-core's token-dispatcher interface over epx, for porting a
    Megatron MoE layer: ``token_permutation(hidden_states, probs,
    routing_map)`` -> (global_input_tokens, tokens_per_expert) and
    ``token_unpermutation(expert_output)`` -> (output, None), also named
    dispatch / combine. probs [T, E] (dense router probabilities) and
    routing_map [T, E] bool (the selected experts) are Megatron's; the
    weights are applied in combine (Megatron's unpermute), and their
    gradient flows back into probs.

    global_input_tokens [N_max, H] are grouped by local expert
    (``self.tokens_per_expert`` rows each, a device tensor: no host wait;
    :meth:`tokens_per_expert_host` gives a list); rows past the valid count
    are zeros. exact_size=True: [N, H], the received rows only, as Megatron
    returns (one host sync per dispatch; see :func:`dispatch` for each mode's
    memory). validate (default True): routing_map rows with more than top_k
    experts, and selected experts whose probability is not positive and
    finite, are refused (a host read of the map per call; False skips it,
    e.g. inside a CUDA graph)."""

    def __init__(self, comm, num_experts, hidden_size, top_k, *, max_tokens_per_rank,
                 dtype=_F32, device="cpu", weighting=Weighting.IN_COMBINE, validate=True,
                 exact_size=False, **buffer_fields):
        self.num_experts, self.top_k = num_experts, top_k
        self.validate, self.exact_size = bool(validate), bool(exact_size)
        self.num_local_experts = num_experts // comm.size
        self.local_expert_indices = list(range(comm.rank * self.num_local_experts,
                                               (comm.rank + 1) * self.num_local_experts))
        self.weighting = Weighting(weighting)
        self.buffer = make_buffer(comm, hidden=hidden_size, num_experts=num_experts,
                                  max_top_k=top_k, max_tokens_per_rank=max_tokens_per_rank,
                                  dtype=dtype, device=device, **buffer_fields)
        self._d = None
        self._shape = None
        self.tokens_per_expert = None

    def token_permutation(self, hidden_states, probs, routing_map):
        """hidden_states [..., H], probs [T, E], routing_map [T, E] bool ->
        (global_input_tokens [N_max, H], tokens_per_expert [E_local])."""
        self._check_permutation_inputs(hidden_states, probs, routing_map)
        if self.validate:
            self._check_routing(hidden_states, probs, routing_map)
        self._shape = hidden_states.shape
        x = hidden_states.reshape(-1, self._shape[-1])
        E = self.num_experts
        # The selected experts in ascending id order (Megatron's permutation order).
        rank_of = (E - _torch.arange(E, device=routing_map.device)).to(_I32)
        key = routing_map.to(_I32) * rank_of
        top, idx = _torch.topk(key, self.top_k, dim=1)
        idx = _torch.where(top > 0, idx, _torch.full_like(idx, -1)).to(_I32)
        w = _torch.where(top > 0, probs.gather(1, idx.clamp(min=0).long()).float(),
                         _torch.zeros((), device=probs.device))
        self._d = dispatch(self.buffer, x, idx, w, weighting=self.weighting,
                           exact_size=self.exact_size)
        self.tokens_per_expert = self._d.counts
        return self._d.recv_x, self._d.counts

    dispatch = token_permutation

    def _check_permutation_inputs(self, hidden_states, probs, routing_map):
        fn = "TokenDispatcher.token_permutation"
        H, E = self.buffer.hidden, self.num_experts
        if not isinstance(hidden_states, Tensor) or hidden_states.dim() < 1 or \
                hidden_states.shape[-1] != H:
            _epx._invalid("%s: hidden_states has shape %s; expected [..., %d] (a torch.Tensor)",
                          fn, list(getattr(hidden_states, "shape", [])), H)
        T = hidden_states.numel() // H
        for name, t in (("probs", probs), ("routing_map", routing_map)):
            if not isinstance(t, Tensor) or tuple(t.shape) != (T, E):
                _epx._invalid("%s: %s has shape %s; expected [%d, %d] (tokens, experts)", fn,
                              name, list(getattr(t, "shape", [])), T, E)
        if not probs.dtype.is_floating_point:
            _epx._invalid("%s: probs has dtype %s; pass the router's float probabilities", fn,
                          probs.dtype)
        if routing_map.dtype.is_floating_point or routing_map.dtype.is_complex:
            _epx._invalid("%s: routing_map has dtype %s; pass Megatron's bool map", fn,
                          routing_map.dtype)

    def _check_routing(self, hidden_states, probs, routing_map):
        """What the dispatch would otherwise get wrong silently: rows of
        routing_map with more than top_k experts (the extra ones would be
        dropped), selected experts without a positive finite probability
        (probs and map that disagree: Megatron's sparse probs from another
        routing, or another token order), tokens of another dtype or device
        than the buffer's. probs may be dense (only the selected entries are
        read) or Megatron's sparse ones. Reads the map on the host (a device
        wait on CUDA; validate=False skips)."""
        fn = "TokenDispatcher.token_permutation"
        want = torch_dtype(self.buffer.dtype)
        if hidden_states.dtype != want:
            _epx._invalid("%s: hidden_states is %s but the dispatcher's buffer is %s; pass "
                          "hidden_states.to(%s) (or make the dispatcher with dtype=%s)", fn,
                          hidden_states.dtype, want, want, hidden_states.dtype)
        dev_kind = "cuda" if self.buffer.device == Device.CUDA else "cpu"
        for name, t in (("hidden_states", hidden_states), ("probs", probs),
                        ("routing_map", routing_map)):
            if t.device.type != dev_kind:
                _epx._invalid("%s: %s is on %s but the dispatcher's buffer is on %s; move it",
                              fn, name, t.device, dev_kind)
        chosen = routing_map != 0
        per_row = chosen.sum(dim=1)
        worst = int(per_row.max()) if per_row.numel() else 0
        if worst > self.top_k:
            row = int(_torch.argmax((per_row > self.top_k).to(_I32)))
            _epx._invalid("%s: routing_map row %d selects %d experts but top_k is %d; every "
                          "token may go to at most top_k experts (make the dispatcher with "
                          "top_k=%d, or fix the router)", fn, row, int(per_row[row]), self.top_k,
                          worst)
        weightless = chosen & ~(probs > 0) & ~_torch.isinf(probs)
        weightless |= chosen & ~_torch.isfinite(probs)
        if bool(weightless.any()):
            t, e = (int(v) for v in weightless.nonzero()[0])
            _epx._invalid("%s: routing_map[%d, %d] selects expert %d but probs[%d, %d] is %g; "
                          "every selected expert needs a positive, finite probability (are probs "
                          "and routing_map from the same router call, in the same token "
                          "order?)", fn, t, e, e, t, e, float(probs[t, e]))

    def token_unpermutation(self, hidden_states, bias=None):
        """expert output [N_max, H] -> (output in the shape of the
        dispatched hidden_states, None). bias is refused (Megatron's
        mlp_bias path has no epx equivalent yet)."""
        if bias is not None:
            _epx._refuse(Status.ERROR_UNSUPPORTED, "TokenDispatcher.token_unpermutation: bias is "
                         "not supported; add it to the expert output before combine")
        if self._d is None:
            _epx._invalid("TokenDispatcher.token_unpermutation: call token_permutation first")
        out = combine(self._d, hidden_states)
        self._d = None
        return out.reshape(self._shape), None

    def combine(self, hidden_states):
        return self.token_unpermutation(hidden_states)[0]

    def tokens_per_expert_host(self):
        """tokens_per_expert as a list of ints (waits for the device on CUDA)."""
        return [int(c) for c in self.tokens_per_expert.tolist()]

    def close(self):
        """Closes the dispatcher's buffer (not collective). A dispatch whose
        combine or backward has not run still holds it: epx.BusyError, as
        Buffer.close. Closing twice does nothing."""
        self._d = None
        self.tokens_per_expert = None
        self.buffer.close()

    @property
    def closed(self):
        return self.buffer.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------
# Activation checkpointing: recompute replays the recorded handles
# ---------------------------------------------------------------------------


class _RecorderScope:
    """One side of a checkpointed call: the forward records every dispatch's
    handle into the recorder, the recompute replays them in order (no layout
    exchange; validated against the routing) and then closes it. ``stats``
    is the recorder's epx.RecorderStats (its last, once closed)."""

    def __init__(self, recorder, mode, close_after):
        self.recorder, self.mode, self.close_after = recorder, mode, close_after
        self._last = None
        self._previous = None

    @property
    def stats(self):
        return self._last if self.recorder.closed else self.recorder.stats()

    def __enter__(self):
        rec = self.recorder
        if not rec.closed:
            rec.set_mode(self.mode)
        self._previous = getattr(_ambient, "recorder", None)
        _ambient.recorder = rec
        return self

    def __exit__(self, *exc):
        _ambient.recorder = self._previous
        if self.close_after and not self.recorder.closed:
            self._last = self.recorder.stats()
            self.recorder.close()


def checkpoint_context(validate=True):
    """The ``context_fn`` of torch.utils.checkpoint that replays epx handles::

        out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False,
                                                context_fn=epx.torch.checkpoint_context)

    The forward records each dispatch's handle; the recompute in backward
    replays them in order instead of recomputing the layouts (bit-identical
    results; with validate, a recompute that routes differently raises
    epx.ReplayMismatchError naming the call). The recorder is closed when the
    recompute ends (a second backward through the same graph lays out
    afresh)."""
    rec = _epx.Recorder(validate=validate)
    forward = _RecorderScope(rec, _epx.RecorderMode.RECORD, False)
    recompute = _RecorderScope(rec, _epx.RecorderMode.REPLAY, True)
    return forward, recompute


# ---------------------------------------------------------------------------
# torch.distributed: a comm from a process group
# ---------------------------------------------------------------------------

_MPI_LAUNCH_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def _comm_config(timeout_seconds):
    return _epx.CommConfig() if timeout_seconds is None else \
        _epx.CommConfig(timeout_seconds=float(timeout_seconds))


def _nccl_comm(group, rank, size, config):
    import torch.distributed as dist
    fn = "epx.torch.comm_from_process_group"
    if not _epx.has_nccl():
        _epx._refuse(Status.ERROR_UNSUPPORTED, "%s: the group is an NCCL group but this libepx "
                     "(%s) has no NCCL transport; build it with -DEPX_BUILD_CUDA=ON and NCCL "
                     "(pip install ./python on a machine with nvcc)", fn, _epx.library_path)
    uid = _lib.NcclUniqueId()
    if rank == 0:
        _epx._check(lib.epx_nccl_get_unique_id(ctypes.byref(uid)))
    dev = _torch.device("cuda", _torch.cuda.current_device())
    # All 128 bytes: a c_char array's .bytes value stops at its first NUL, and
    # an ncclUniqueId has zeros inside (its socket address).
    raw = _torch.frombuffer(bytearray(ctypes.string_at(ctypes.addressof(uid), 128)), dtype=_torch.uint8)
    shared = raw.to(dev)
    dist.broadcast(shared, src=dist.get_global_rank(group, 0), group=group)
    ctypes.memmove(ctypes.addressof(uid), bytes(shared.cpu().tolist()), 128)
    p = ctypes.c_void_p()
    _epx._check(lib.epx_comm_create_nccl_id(ctypes.byref(uid), rank, size, ctypes.byref(config),
                                            ctypes.byref(p)))
    return _epx.Comm(p.value)


def _mpi_world_without_mpi4py(fn):
    """MPI_COMM_WORLD's handle, for an MPI the library links, found with
    ctypes (Open MPI: &ompi_mpi_comm_world; MPICH: 0x44000000), MPI
    initialised (and finalised at exit) if it was not."""
    import atexit
    import ctypes.util
    name = ctypes.util.find_library("mpi")
    if name is None:
        _epx._refuse(Status.ERROR_UNSUPPORTED, "%s: libmpi was not found; install mpi4py "
                     "(pip install mpi4py, or apt-get install python3-mpi4py)", fn)
    mpi = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    flag = ctypes.c_int(0)
    mpi.MPI_Initialized(ctypes.byref(flag))
    if not flag.value:
        provided = ctypes.c_int(0)
        if mpi.MPI_Init_thread(None, None, 3, ctypes.byref(provided)) != 0:  # MPI_THREAD_MULTIPLE
            _epx._refuse(Status.ERROR_TRANSPORT, "%s: MPI_Init_thread failed", fn)
        atexit.register(mpi.MPI_Finalize)
    try:
        handle = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.in_dll(mpi, "ompi_mpi_comm_world")))
    except ValueError:
        handle = ctypes.c_int(0x44000000)  # MPICH's MPI_COMM_WORLD
    return handle


def _mpi_comm(group, rank, size, config):
    import torch.distributed as dist
    fn = "epx.torch.comm_from_process_group"
    if not any(v in os.environ for v in _MPI_LAUNCH_VARS):
        _epx._refuse(Status.ERROR_UNSUPPORTED, "%s: transport 'mpi' needs processes started by "
                     "mpirun; launch with `mpirun -np %d python your_script.py`, or use "
                     "transport='shm' for processes of one host", fn, size)
    if not _epx.has_mpi():
        _epx._refuse(Status.ERROR_UNSUPPORTED, "%s: this libepx (%s) was built without MPI "
                     "(a CMake build has it when MPI is found at configure time; the wheel only "
                     "when built with SKBUILD_CMAKE_DEFINE=EPX_BUILD_MPI=ON). Processes of one "
                     "host need no MPI: transport='shm'", fn, _epx.library_path)
    ranks = [dist.get_global_rank(group, r) for r in range(size)]
    try:
        from mpi4py import MPI
    except ImportError:
        MPI = None
    if MPI is not None:
        world = MPI.COMM_WORLD
        if world.Get_rank() != dist.get_rank():
            _epx._invalid("%s: torch rank %d is MPI rank %d; initialise torch.distributed with "
                          "the MPI ranks (rank=OMPI_COMM_WORLD_RANK)", fn, dist.get_rank(),
                          world.Get_rank())
        mpi_comm = world if ranks == list(range(world.Get_size())) else \
            world.Create_group(world.Get_group().Incl(ranks))
        return _epx.Comm.from_mpi(mpi_comm, config)
    world = _mpi_world_without_mpi4py(fn)
    if ranks != list(range(dist.get_world_size())):
        _epx._refuse(Status.ERROR_UNSUPPORTED, "%s: a sub-group of the world needs mpi4py to "
                     "make its MPI communicator; install mpi4py", fn)
    p = ctypes.c_void_p()
    _epx._check(lib.epx_comm_create_mpi(ctypes.addressof(world), ctypes.byref(config),
                                        ctypes.byref(p)))
    comm = _epx.Comm(p.value)
    if comm.size != size:
        _epx._invalid("%s: MPI_COMM_WORLD has %d ranks but the group %d; launch as many MPI "
                      "ranks as torch ranks", fn, comm.size, size)
    return comm


def _shm_comm(group, rank, size, config):
    """The shm transport over the group's processes: they gather their hosts
    and rank 0's fresh segment name through the group (one all_gather_object),
    then meet in /dev/shm."""
    import secrets
    import socket
    import torch.distributed as dist
    fn = "epx.torch.comm_from_process_group"
    mine = (socket.gethostname(), "epx-%d-%s" % (os.getpid(), secrets.token_hex(8)))
    every = [None] * size
    dist.all_gather_object(every, mine, group=group)
    hosts = sorted({h for h, _ in every})
    if len(hosts) > 1:
        _epx._refuse(Status.ERROR_UNSUPPORTED, "%s: the group spans %d hosts (%s); transport "
                     "'shm' joins processes of one host only; across hosts use transport='mpi' "
                     "under mpirun, or an NCCL group", fn, len(hosts), ", ".join(hosts[:4]))
    return _epx.Comm.from_shm(every[0][1], rank, size, config)


_TRANSPORTS = ("shm", "mpi", "nccl")


def _transport_of(group, transport, fn):
    import torch.distributed as dist
    if transport is not None:
        if transport not in _TRANSPORTS:
            _epx._invalid("%s: transport is %r; pass None (chosen from the group) or one of %s",
                          fn, transport, ", ".join(map(repr, _TRANSPORTS)))
        return transport
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return "nccl"
    return "shm" if _one_host() else "mpi"


def _one_host():
    """Whether the launcher says every process is on this host (torchrun's
    LOCAL_WORLD_SIZE, mpirun's local size); unknown counts as one host, which
    the shm transport then checks."""
    size = os.environ.get("WORLD_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE")
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    return size is None or local is None or size == local


def comm_from_process_group(group=None, *, timeout_seconds=None, transport=None):
    """An epx.Comm over the ranks of a torch.distributed process group (the
    default group when None), in one call; collective over the group. No
    rebuild and no environment mapping: the launcher (torchrun, mpirun) is
    whatever started torch.distributed.

    transport (None: chosen from the group):

    - ``"nccl"`` (NCCL groups; GPUs, one process per GPU, the current CUDA
      device set): rank 0 makes an NCCL unique id, the group broadcasts it,
      every rank creates epx's NCCL comm on its current device.
    - ``"shm"`` (CPU groups, e.g. gloo under torchrun, every process on one
      host): the processes meet in POSIX shared memory (epx_comm_create_shm),
      the segment's name passed through the group; needs no MPI.
    - ``"mpi"`` (CPU groups across hosts): the MPI transport over the same
      processes, which mpirun must have started (MPI_COMM_WORLD through mpi4py
      when installed, else found through the MPI libepx links); needs a libepx
      built with MPI.
    """
    import torch.distributed as dist
    fn = "epx.torch.comm_from_process_group"
    if not dist.is_available() or not dist.is_initialized():
        _epx._invalid("%s: torch.distributed is not initialised; call "
                      "torch.distributed.init_process_group (or epx.torch.init_process_group) "
                      "first", fn)
    if group is None:
        group = dist.group.WORLD
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    config = _comm_config(timeout_seconds)
    chosen = _transport_of(group, transport, fn)
    if chosen == "nccl":
        return _nccl_comm(group, rank, size, config)
    if chosen == "shm":
        return _shm_comm(group, rank, size, config)
    return _mpi_comm(group, rank, size, config)


# Each launcher's rank, size, local rank and local size, in torch's names.
_LAUNCHERS = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),                      # torchrun
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),                                                 # Open MPI
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),               # MPICH, Intel
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),    # srun
)
_JOB_IDS = ("TORCHELASTIC_RUN_ID", "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_KVSNAME",
            "SLURM_JOB_ID")


def launch_env():
    """(rank, world_size, local_rank, local_world_size) from whichever
    launcher started this process (torchrun's variables first, then mpirun's
    OMPI_COMM_WORLD_*, MPICH's PMI_*, srun's SLURM_*); None if none did."""
    for names in _LAUNCHERS:
        if names[0] in os.environ and names[1] in os.environ:
            rank, size = int(os.environ[names[0]]), int(os.environ[names[1]])
            local_rank = int(os.environ.get(names[2], rank))
            local_size = os.environ.get(names[3], str(size)).split("(")[0].split(",")[0]
            return rank, size, local_rank, int(local_size)
    return None


def _job_store(job, rank, size, timeout):
    """A TCPStore for the ranks of one host: rank 0 serves it on a free port
    and writes the port to a file named after the job id, which the others
    read; rank 0 removes the file once every rank has joined."""
    import datetime
    import tempfile
    import time
    import torch.distributed as dist
    fn = "epx.torch.init_process_group"
    timeout = timeout or datetime.timedelta(minutes=5)
    path = os.path.join(tempfile.gettempdir(), "epx-torch-%s.port" % job)
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout, wait_for_workers=False)
        with open(path + ".%d" % os.getpid(), "w") as f:
            f.write(str(store.port))
        os.replace(path + ".%d" % os.getpid(), path)
        try:
            while store.add("epx/joined", 0) < size - 1:
                if time.monotonic() > deadline:
                    _epx._refuse(Status.ERROR_TIMEOUT, "%s: %d of %d ranks joined rank 0's store "
                                 "within %s", fn, store.add("epx/joined", 0) + 1, size, timeout)
                time.sleep(0.01)
        finally:
            os.remove(path)
        return store
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            _epx._refuse(Status.ERROR_TIMEOUT, "%s: rank 0 did not publish its store (%s) within "
                         "%s; is rank 0 running?", fn, path, timeout)
        time.sleep(0.01)
    with open(path) as f:
        port = int(f.read())
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout)
    store.add("epx/joined", 1)
    return store


def init_process_group(backend=None, **kwargs):
    """torch.distributed.init_process_group for a process started by
    torchrun, mpirun, mpiexec (MPICH) or srun, with no variables to map: the
    rank and size come from the launcher (:func:`launch_env`), and where
    MASTER_ADDR/MASTER_PORT are unset and every rank is on this host, rank 0
    serves a TCPStore on a free port that it tells the others through a file
    named after the launcher's job id (removed once all have joined). backend
    None: "nccl" where torch sees a GPU, else "gloo". Other keyword arguments
    go to torch.distributed.init_process_group."""
    import torch.distributed as dist
    fn = "epx.torch.init_process_group"
    env = launch_env()
    if env is None:
        _epx._invalid("%s: no launcher's variables found (RANK/WORLD_SIZE of torchrun, "
                      "OMPI_COMM_WORLD_* of mpirun, PMI_* of mpiexec, SLURM_* of srun); "
                      "launch with one of them", fn)
    rank, size, _, local_size = env
    if backend is None:
        backend = "nccl" if _torch.cuda.is_available() else "gloo"
    kwargs.setdefault("rank", rank)
    kwargs.setdefault("world_size", size)
    if "init_method" not in kwargs and "store" not in kwargs and not (
            "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ):
        job = next((os.environ[v] for v in _JOB_IDS if v in os.environ), None)
        if local_size != size or job is None:
            _epx._invalid("%s: set MASTER_ADDR and MASTER_PORT (rank 0's host and a free port): "
                          "the ranks span hosts, or the launcher gives no job id", fn)
        kwargs["store"] = _job_store(job, rank, size, kwargs.get("timeout"))
    dist.init_process_group(backend, **kwargs)
