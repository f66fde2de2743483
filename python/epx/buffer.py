"""Buffer: one layer's exchange state (epx_buffer_t) and every call on it:
layout, dispatch, combine, their backward passes, fp8 and low-latency
variants."""
import contextlib
import ctypes
import math
import threading
import weakref

import numpy as np

from . import _lib
from ._lib import BufferConfig, Device, DType, ExchangePath, Layout, lib, Status, Weighting
from .arrays import (_as_dtype, empty, _F32, _I32, _NP_OF_DTYPE, PAYLOAD_ALIGNMENT,
                     _payload_dtypes, _ptr)
from .errors import _check, EpxError, _invalid, _refuse
from .fp8 import fp8_scale_shape
from .handle import Handle
from .ownership import _BUFFERS, _busy, _Closable, _destroy, _register, _released
from .placement import Placement
from .routing import RouteResult


class Buffer(_Closable):
    """The exchange memory of one MoE layer over a comm (epx_buffer_create,
    collective). config is a :class:`BufferConfig`; keyword arguments set its
    fields (dtype may also be a name or numpy dtype). placement: an
    :class:`epx.Placement` (the buffer's physical experts: experts_per_rank
    is then P / W; see epx.placement) or None, the contiguous map."""

    def __init__(self, comm, config=None, *, placement=None, **fields):
        if "dtype" in fields:
            fields["dtype"] = _as_dtype(fields["dtype"])
        if config is None:
            config = BufferConfig(**fields)
        elif fields:
            config = config.copy(**fields)
        ptr = comm._handle("Buffer")
        config, self.placement = _with_placement(comm, ptr, config, placement)
        p = ctypes.c_void_p()
        _check(lib.epx_buffer_create(ptr, ctypes.byref(config), ctypes.byref(p)))
        # A successful creation may still leave a note: why the fused path
        # was refused (every peer then takes the host path; epx.h,
        # EPX_PATH_AUTO). Empty where there is none.
        self.creation_note = lib.epx_last_error().decode("utf-8", "replace")
        self._ptr = p.value
        self.comm = comm
        self.config = config.copy()
        self.dtype = DType(config.dtype)
        self.device = Device(config.device)
        self.hidden = int(config.hidden)
        self.num_experts = int(config.num_experts)
        self.experts_per_rank = (self.placement.num_physical if self.placement is not None
                                 else self.num_experts) // comm.size
        self.layout = Layout(config.layout)
        self.stream = config.stream  # the CUDA stream of its calls (set_stream changes it)
        self._payload = _payload_dtypes(self.dtype)
        self._lock = threading.RLock()
        self._handles = weakref.WeakSet()
        with comm._lock:
            comm._buffers.add(self)
        self.id = _register(_BUFFERS, self)

    # -- state ---------------------------------------------------------------

    def _handle_ptr(self, fn):
        if self._ptr is None:
            _released(fn, "buffer", "closed; create a new one")
        return self._ptr

    @property
    def np_dtype(self):
        """The numpy dtype of payload arrays (uint16 for bfloat16)."""
        return _NP_OF_DTYPE[self.dtype]

    @property
    def max_tokens(self):
        """Agreed tokens per rank (0 until the first dispatch_layout agrees it)."""
        v = ctypes.c_int64()
        _check(lib.epx_buffer_max_tokens(self._handle_ptr("Buffer.max_tokens"), ctypes.byref(v)))
        return v.value

    def max_recv_rows(self):
        """Upper bound of any handle's recv rows on this buffer."""
        v = ctypes.c_int64()
        _check(lib.epx_buffer_max_recv_rows(self._handle_ptr("Buffer.max_recv_rows"),
                                            ctypes.byref(v)))
        return v.value

    def peer_paths(self):
        """How this buffer moves rows to each rank of its comm
        (epx_buffer_peer_paths, not collective): a list of
        :class:`ExchangePath` (FUSED or HOST), one per rank, this rank's own
        entry included: on the fused path FUSED for the ranks reached by
        load/store (NVLink) and HOST for the others, which NCCL's host API
        serves inside the same calls. HOST everywhere on CPU buffers,
        one-rank buffers, and CUDA buffers of processes sharing a GPU (an
        shm comm, the ipc transport: epx.torch.comm_from_process_group);
        where the fused path was refused at creation, ``creation_note`` says
        why."""
        n = self.comm.size
        paths = (ctypes.c_int32 * n)()
        _check(lib.epx_buffer_peer_paths(self._handle_ptr("Buffer.peer_paths"), paths))
        return [ExchangePath(v) for v in paths]

    def expert_load(self, reset=False):
        """Routes per logical expert ([E] int64) this rank's layouts took
        since creation or the last reset (epx_buffer_expert_load; reset
        zeroes them after reading). Rank-local: sum over the ranks
        (comm.allgather(...).sum(0)) for :meth:`epx.Placement.plan`."""
        load = empty((self.num_experts,), np.int64)
        _check(lib.epx_buffer_expert_load(self._handle_ptr("Buffer.expert_load"), load.ctypes.data,
                                          1 if reset else 0))
        return load

    def replica_grad_sum(self, grads):
        """Sums each replicated expert's gradients over its replicas, in
        place (epx_replica_grad_sum, collective; CPU buffers): grads
        [E_local, ...] float32, C-contiguous, this rank's physical experts
        in slot order; afterwards every replica holds the same sum. Returns
        grads."""
        fn = "Buffer.replica_grad_sum"
        with self._together("replica_grad_sum"):
            self._host(fn)
            if not isinstance(grads, np.ndarray) or grads.ndim < 1:
                _ptr(grads, fn, "grads", _F32, (self.experts_per_rank, None))
            _ptr(grads, fn, "grads", _F32, (self.experts_per_rank,) + grads.shape[1:],
                 writable=True)
        count = math.prod(grads.shape[1:])
        _check(lib.epx_replica_grad_sum(self._handle_ptr(fn), grads.ctypes.data if grads.size
                                        else None, count))
        return grads

    def set_stream(self, stream):
        """The CUDA stream (a cudaStream_t as an int) of later calls."""
        _check(lib.epx_buffer_set_stream(self._handle_ptr("Buffer.set_stream"), stream))
        self.stream = stream

    def close(self):
        """Releases the handles this Python code still holds on the buffer,
        then destroys it (epx_buffer_destroy, not collective). A recorder
        holding handles keeps it busy: EpxError EPX_ERROR_BUSY, and the buffer
        stays open until the recorder is closed (where an exception is already
        propagating through the close, the BUSY becomes a note on it rather
        than replacing it). Closing twice does nothing."""
        with self._lock:
            handles = list(self._handles)
        held = [h for h in handles if h._autograd and not h.released]
        if held:
            _busy("Buffer.close: %d handle(s) of this buffer are held by epx.torch (an autograd "
                  "graph whose backward has not run yet, or a Dispatched result still "
                  "referenced), and the backward would replay them; run the backward, or drop "
                  "those outputs, before closing" % len(held))
            return
        for h in handles:
            h.release()
        _destroy(self, lib.epx_buffer_destroy, self._lock)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        return "<epx.Buffer %s H=%d E=%d rank %d of %d%s>" % (
            self.dtype.name.lower(), self.hidden, self.num_experts, self.comm.rank, self.comm.size,
            " closed" if self.closed else "")

    def _host(self, fn):
        if self.device != Device.CPU:
            _refuse(Status.ERROR_UNSUPPORTED, "%s: the buffer is a CUDA buffer and numpy arrays "
                    "are host memory; use epx.torch with CUDA tensors", fn)

    # -- pointer level (used by epx.torch; no argument checks here) ----------

    @contextlib.contextmanager
    def _together(self, op, handle=None):
        """Wraps the checks made in Python before collective call `op`. If one
        refuses, the call is still made, with an address the library refuses
        before reading anything, so that the peers fail at once with
        EPX_ERROR_PEER_FAILED naming this rank (as for a refusal made by the
        library) instead of waiting for this rank until the comm's timeout."""
        try:
            yield
        except EpxError as e:
            if not e.in_library:
                self._fail_peers(op, handle)
            raise

    def _fail_peers(self, op, handle):
        if self._ptr is None or self.comm.size == 1:
            return
        if op == "layout":
            r = _lib.Routing(-1, 1, None, None, None, int(Weighting.IN_COMBINE))
            unused = ctypes.c_void_p()
            lib.epx_dispatch_layout(self._ptr, ctypes.byref(r), None, ctypes.byref(unused))
            return
        if op == "replica_grad_sum":
            lib.epx_replica_grad_sum(self._ptr, None, -1)
            return
        if op == "ll_dispatch":
            r = _lib.Routing(-1, 1, None, None, None, int(Weighting.IN_COMBINE))
            unused = ctypes.c_void_p()
            lib.epx_ll_dispatch(self._ptr, ctypes.byref(r), None, None, None, None, ctypes.byref(unused))
            return
        h = handle._ptr if isinstance(handle, Handle) and handle.buffer is self else None
        if h is None:
            return  # a dead or foreign handle: the library returns at once there too
        bad = 1  # a misaligned payload address, refused first
        if op == "ll_combine":
            lib.epx_ll_combine(self._ptr, h, bad, bad)
            return
        if op == "dispatch":
            lib.epx_dispatch(self._ptr, h, bad, bad, -1)
        elif op == "dispatch_fp8":
            lib.epx_dispatch_fp8(self._ptr, h, bad, bad, bad, bad, -1)
        elif op == "dispatch_quantize":
            lib.epx_dispatch_quantize(self._ptr, h, bad, bad, bad, -1)
        elif op == "combine":
            lib.epx_combine(self._ptr, h, bad, bad)
        elif op == "dispatch_backward":
            lib.epx_dispatch_backward(self._ptr, h, bad, bad, None, None)
        elif op == "weights_backward":
            lib.epx_weights_backward(self._ptr, h, bad, bad)
        else:
            lib.epx_combine_backward(self._ptr, h, bad, None, bad, None)

    # -- low-latency decode (config.low_latency = 1; epx.h, "Low-latency decode")

    def ll_shape(self):
        """The fixed receive shape of the low-latency calls: (E_local, W *
        max_tokens, H) expert-major (DeepEP's), (W, max_tokens, H) rank-major;
        recv_count has its first dimension."""
        W, m = self.comm.size, self.max_tokens
        if self.layout == Layout.RANK_MAJOR:
            return (W, m, self.hidden)
        return (self.experts_per_rank, W * m, self.hidden)

    def _ll_dispatch(self, step_tokens, top_k, idx, w, weighting, num_tokens, x, recv_x, recv_count,
                     send_only, rows=None):
        """epx_ll_dispatch(_send) on addresses; num_tokens an address or None,
        rows the routing's rows when num_tokens is given."""
        fn = "Buffer.ll_dispatch"
        r = _lib.Routing(int(step_tokens if rows is None else rows), int(top_k), idx, w, None,
                         int(weighting))
        p = ctypes.c_void_p()
        call = lib.epx_ll_dispatch_send if send_only else lib.epx_ll_dispatch
        _check(call(self._handle_ptr(fn), ctypes.byref(r), num_tokens, x, recv_x, recv_count,
               ctypes.byref(p)))
        return Handle(self, p.value, int(step_tokens), int(top_k), Weighting(weighting))

    def ll_dispatch(self, x, topk_idx, topk_w=None, *, num_tokens=None,
                    weighting=Weighting.IN_COMBINE, out=None, recv_count=None, send_only=False):
        """One decode step's dispatch (epx_ll_dispatch, collective; DeepEP's
        low_latency_dispatch) -> (recv_x, recv_count, handle).

        x [T, H], topk_idx [T, K] int32, topk_w [T, K] float32; num_tokens:
        the step's count when x and the routing hold more rows (T is then
        their rows). recv_x has the fixed shape ll_shape(): expert e's rows
        are recv_x[e, :recv_count[e]] (rank-major: source rank s's), in the
        normal layout's order; handle.recv_source() gives each row's (rank,
        token) over the flattened rows. send_only: epx_ll_dispatch_send;
        call ll_complete(handle) before reading recv_x and recv_count."""
        fn = "Buffer.ll_dispatch"
        with self._together("ll_dispatch"):
            T, K, pi, pw, _ = self._routing_args(fn, topk_idx, topk_w, None)
            count, step = _ll_step(fn, T, num_tokens)
            px = self._payload_in(x, T, fn, "x")
            shape = self.ll_shape()
            if out is None:
                out = empty(shape, self.np_dtype)
            po = _ptr(out, fn, "out", self._payload, shape, align=PAYLOAD_ALIGNMENT, writable=True)
            if recv_count is None:
                recv_count = empty((shape[0],), np.int32)
            pc = _ptr(recv_count, fn, "recv_count", _I32, (shape[0],), writable=True)
        h = self._ll_dispatch(step, K, pi, pw, weighting,
                              ctypes.addressof(count) if count is not None else None, px, po, pc,
                              send_only, rows=T)
        return out, recv_count, h

    def ll_dispatch_fp8(self, x, topk_idx, topk_w=None, *, x_scales=None, num_tokens=None,
                        weighting=Weighting.IN_COMBINE, send_only=False):
        """The step's dispatch in the buffer's fp8_format (epx_ll_dispatch_fp8;
        DeepEP's use_fp8) -> (recv_x_q, recv_scales, recv_count, handle).
        x [T, H] of the buffer's dtype is quantized on the way (x_scales None),
        or x is e4m3 bytes (uint8) with x_scales [T, scale_cols]. recv_x_q is
        ll_shape() of uint8, recv_scales ll_shape()[:2] + (scale_cols,)
        (row-major, see fp8_scale_shape); each row and its scales are the
        normal fp8 dispatch's. send_only as in ll_dispatch."""
        fn = "Buffer.ll_dispatch_fp8"
        with self._together("ll_dispatch"):
            T, K, pi, pw, _ = self._routing_args(fn, topk_idx, topk_w, None)
            count, step = _ll_step(fn, T, num_tokens)
            cols, sdt = fp8_scale_shape(self.config.fp8_format, self.hidden)
            if x_scales is None:
                px = self._payload_in(x, T, fn, "x")
            else:
                px = _ptr(x, fn, "x", (np.dtype(np.uint8),), (T, self.hidden), align=PAYLOAD_ALIGNMENT)
                x_scales = _ptr(x_scales, fn, "x_scales", (sdt,), (T, cols), align=1)
            shape = self.ll_shape()
            recv_q = empty(shape, np.uint8)
            recv_s = empty(shape[:2] + (cols,), sdt)
            recv_count = empty((shape[0],), np.int32)
        call = lib.epx_ll_dispatch_fp8_send if send_only else lib.epx_ll_dispatch_fp8
        r = _lib.Routing(int(T), int(K), pi, pw, None, int(weighting))
        p = ctypes.c_void_p()
        _check(call(self._handle_ptr(fn), ctypes.byref(r),
               ctypes.addressof(count) if count is not None else None, px, x_scales,
               recv_q.ctypes.data, recv_s.ctypes.data, recv_count.ctypes.data, ctypes.byref(p)))
        return recv_q, recv_s, recv_count, Handle(self, p.value, int(step), int(K), Weighting(weighting))

    def ll_combine(self, handle, expert_out, out=None, *, send_only=False):
        """The step's combine (epx_ll_combine, collective; DeepEP's
        low_latency_combine): expert_out in ll_shape() -> out [T, H], the
        normal combine's sums. send_only: epx_ll_combine_send; call
        ll_complete(handle) before reading out."""
        fn = "Buffer.ll_combine"
        with self._together("ll_combine", handle):
            self._host(fn)
            pe = _ptr(expert_out, fn, "expert_out", self._payload, self.ll_shape(),
                      align=PAYLOAD_ALIGNMENT)
            if out is None:
                out = empty((handle.num_tokens, self.hidden), self.np_dtype)
            po = _ptr(out, fn, "out", self._payload, (handle.num_tokens, self.hidden),
                      align=PAYLOAD_ALIGNMENT, writable=True)
        call = lib.epx_ll_combine_send if send_only else lib.epx_ll_combine
        _check(call(self._handle_ptr(fn), handle._use(self, fn), pe, po))
        return out

    def ll_complete(self, handle):
        """Finishes the handle's pending ll_dispatch / ll_combine send (epx_ll_complete)."""
        fn = "Buffer.ll_complete"
        _check(lib.epx_ll_complete(self._handle_ptr(fn), handle._use(self, fn)))

    # -- the active-rank mask (epx.h, epx_ll_mask_rank; DeepEP's mask calls)

    def ll_mask_rank(self, rank, masked=True):
        """Masks (or, masked=False, unmasks) a peer rank for this rank's later
        collectives over the buffer's comm (epx_ll_mask_rank): they complete
        among the unmasked ranks, and routes to a masked rank's experts are
        dropped. Every survivor masks the same ranks; a local call, not a
        collective. CPU buffers over a local or shm comm; elsewhere
        EPX_ERROR_UNSUPPORTED."""
        _check(lib.epx_ll_mask_rank(self._handle_ptr("Buffer.ll_mask_rank"), int(rank), 1 if masked else 0))

    def ll_query_mask(self):
        """The mask as a list of W ints, 1 for a masked rank (epx_ll_query_mask)."""
        fn = "Buffer.ll_query_mask"
        ptr = self._handle_ptr(fn)
        mask = (ctypes.c_int32 * self.comm.size)()
        _check(lib.epx_ll_query_mask(ptr, mask))
        return list(mask)

    def ll_clean_mask(self):
        """Unmasks every rank (epx_ll_clean_mask)."""
        _check(lib.epx_ll_clean_mask(self._handle_ptr("Buffer.ll_clean_mask")))

    def _layout(self, num_tokens, top_k, idx, w, loc, weighting, recorder):
        fn = "Buffer.dispatch_layout"
        r = _lib.Routing(int(num_tokens), int(top_k), idx, w, loc, int(weighting))
        with self._together("layout"):
            rec = recorder._handle_ptr(fn) if recorder is not None else None
        p = ctypes.c_void_p()
        _check(lib.epx_dispatch_layout(self._handle_ptr(fn), ctypes.byref(r), rec, ctypes.byref(p)))
        h = Handle(self, p.value, int(num_tokens), int(top_k), Weighting(weighting))
        if recorder is not None:
            recorder._buffers.add(self)
        return h

    def _dispatch(self, handle, x, recv_x, capacity):
        fn = "Buffer.dispatch"
        _check(lib.epx_dispatch(self._handle_ptr(fn), handle._use(self, fn), x, recv_x,
                                int(capacity)))

    def _dispatch_fp8(self, handle, x, x_scales, recv_q, recv_scales, capacity):
        """epx_dispatch_fp8, or epx_dispatch_quantize when x_scales is None."""
        fn = "Buffer.dispatch_fp8"
        if x_scales is None:
            _check(lib.epx_dispatch_quantize(self._handle_ptr(fn), handle._use(self, fn), x, recv_q,
                                             recv_scales, int(capacity)))
        else:
            _check(lib.epx_dispatch_fp8(self._handle_ptr(fn), handle._use(self, fn), x, x_scales,
                                        recv_q, recv_scales, int(capacity)))

    def _combine(self, handle, expert_out, out):
        fn = "Buffer.combine"
        _check(lib.epx_combine(self._handle_ptr(fn), handle._use(self, fn), expert_out, out))

    def _dispatch_backward(self, handle, grad_recv_x, grad_x, x, grad_w):
        fn = "Buffer.dispatch_backward"
        _check(lib.epx_dispatch_backward(self._handle_ptr(fn), handle._use(self, fn), grad_recv_x,
                                         grad_x, x, grad_w))

    def _combine_backward(self, handle, grad_out, expert_out, grad_expert_out, grad_w):
        fn = "Buffer.combine_backward"
        _check(lib.epx_combine_backward(self._handle_ptr(fn), handle._use(self, fn), grad_out,
                                        expert_out, grad_expert_out, grad_w))

    # -- numpy level ---------------------------------------------------------

    def dispatch_layout(self, topk_idx, topk_w=None, locations=None, *,
                        weighting=Weighting.IN_COMBINE, recorder=None):
        """The layout of a dispatch (epx_dispatch_layout, collective) -> :class:`Handle`.

        topk_idx [T, K] int32 (or a :class:`RouteResult`, which also gives
        topk_w and, for the capacity layout, locations); topk_w [T, K] float32
        (None only with Weighting.NONE); locations [T, K] int32 for
        Layout.CAPACITY. recorder: a :class:`Recorder` or None.
        """
        fn = "Buffer.dispatch_layout"
        with self._together("layout"):
            args = self._routing_args(fn, topk_idx, topk_w, locations)
        return self._layout(*args, weighting, recorder)

    def _routing_args(self, fn, topk_idx, topk_w, locations):
        self._host(fn)
        if isinstance(topk_idx, RouteResult):
            rr = topk_idx
            topk_idx = rr.topk_idx
            if topk_w is None:  # also with Weighting.NONE: recv_routing reports them
                topk_w = rr.topk_w
            if locations is None and self.layout == Layout.CAPACITY:
                locations = rr.locations
        if not isinstance(topk_idx, np.ndarray) or topk_idx.ndim != 2:
            _ptr(topk_idx, fn, "topk_idx", _I32, (None, None))
        T, K = topk_idx.shape
        pi = _ptr(topk_idx, fn, "topk_idx", _I32, (T, K))
        pw = _ptr(topk_w, fn, "topk_w", _F32, (T, K), optional=True)
        pl = _ptr(locations, fn, "locations", _I32, (T, K), optional=True)
        return T, K, pi, pw, pl

    def _rows_out(self, out, rows, fn, name):
        """An output payload array of at least `rows` rows ([..., H]): `out`
        checked, or a new [rows, H] one. Returns it, its address and its rows."""
        if out is None:
            out = empty((rows, self.hidden), self.np_dtype)
            return out, out.ctypes.data, rows
        if not isinstance(out, np.ndarray) or out.ndim < 2 or out.shape[-1] != self.hidden:
            _invalid("%s: %s has shape %s; expected [rows, %d]", fn, name, list(np.shape(out)),
                     self.hidden)
        address = _ptr(out, fn, name, self._payload, out.shape, align=PAYLOAD_ALIGNMENT,
                       writable=True)
        return out, address, math.prod(out.shape[:-1])

    def _payload_in(self, a, rows, fn, name):
        return _ptr(a, fn, name, self._payload, (rows, self.hidden), align=PAYLOAD_ALIGNMENT)

    def dispatch(self, handle, x, out=None):
        """x [T, H] -> recv_x [N, H] in the buffer's layout (epx_dispatch,
        collective). out: an array of at least N rows ([..., H], aligned) to
        fill, or None to allocate; returns its first N rows."""
        fn = "Buffer.dispatch"
        with self._together("dispatch", handle):
            self._host(fn)
            n = handle.recv_rows
            px = self._payload_in(x, handle.num_tokens, fn, "x")
            out, po, capacity = self._rows_out(out, n, fn, "out")
        self._dispatch(handle, px, po, capacity)
        return out if capacity == n and out.ndim == 2 else out.reshape(-1, self.hidden)[:n]

    def combine(self, handle, expert_out, out=None):
        """expert_out [N, H] -> out [T, H] = sum_k w[t,k] * expert_out(t,k)
        (epx_combine, collective)."""
        fn = "Buffer.combine"
        with self._together("combine", handle):
            self._host(fn)
            pe = self._payload_in(expert_out, handle.recv_rows, fn, "expert_out")
            if out is None:
                out = empty((handle.num_tokens, self.hidden), self.np_dtype)
            po = _ptr(out, fn, "out", self._payload, (handle.num_tokens, self.hidden),
                      align=PAYLOAD_ALIGNMENT, writable=True)
        self._combine(handle, pe, po)
        return out

    def _grad_w(self, handle, grad_w, needed, inputs_given, fn, input_name, weighting_name):
        """The grad_w array of a backward call (None when not computed)."""
        if grad_w is False or handle.weighting != needed:
            if grad_w is not None and grad_w is not False:
                _invalid("%s: grad_w is given but the handle's weights were not applied in %s; "
                         "pass grad_w=None", fn, weighting_name)
            return None
        if not inputs_given:
            _invalid("%s: %s is None but the handle's weights were applied in %s, so grad_w "
                     "needs the forward's %s; pass it (grad_w is what the router learns from), "
                     "or grad_w=False to skip it", fn, input_name, weighting_name, input_name)
        if grad_w is None:
            return empty((handle.num_tokens, handle.top_k), np.float32)
        _ptr(grad_w, fn, "grad_w", _F32, (handle.num_tokens, handle.top_k), writable=True)
        return grad_w

    def dispatch_backward(self, handle, grad_recv_x, x=None, *, grad_x=None, grad_w=None):
        """grad_recv_x [N, H] -> (grad_x [T, H], grad_w [T, K] or None)
        (epx_dispatch_backward, collective). With Weighting.IN_DISPATCH, grad_w
        needs x (the forward's input); grad_w=False skips it."""
        fn = "Buffer.dispatch_backward"
        with self._together("dispatch_backward", handle):
            self._host(fn)
            pg = self._payload_in(grad_recv_x, handle.recv_rows, fn, "grad_recv_x")
            gw = self._grad_w(handle, grad_w, Weighting.IN_DISPATCH, x is not None, fn, "x",
                              "dispatch")
            if gw is None and x is not None:
                if handle.weighting != Weighting.IN_DISPATCH:
                    _invalid("%s: x is given but the handle's weights were not applied in "
                             "dispatch; pass x=None", fn)
                x = None
            px = self._payload_in(x, handle.num_tokens, fn, "x") if x is not None else None
            if grad_x is None:
                grad_x = empty((handle.num_tokens, self.hidden), self.np_dtype)
            pgx = _ptr(grad_x, fn, "grad_x", self._payload, (handle.num_tokens, self.hidden),
                       align=PAYLOAD_ALIGNMENT, writable=True)
        self._dispatch_backward(handle, pg, pgx, px, gw.ctypes.data if gw is not None else None)
        return grad_x, gw

    def combine_backward(self, handle, grad_out, expert_out=None, *, grad_expert_out=None,
                         grad_w=None):
        """grad_out [T, H] -> (grad_expert_out [N, H], grad_w [T, K] or None)
        (epx_combine_backward, collective). With Weighting.IN_COMBINE, grad_w
        needs expert_out (the forward's input): it is what the router learns
        from; grad_w=False skips it."""
        fn = "Buffer.combine_backward"
        with self._together("combine_backward", handle):
            self._host(fn)
            pg = self._payload_in(grad_out, handle.num_tokens, fn, "grad_out")
            gw = self._grad_w(handle, grad_w, Weighting.IN_COMBINE, expert_out is not None, fn,
                              "expert_out", "combine")
            if gw is None and expert_out is not None:
                if handle.weighting != Weighting.IN_COMBINE:
                    _invalid("%s: expert_out is given but the handle's weights were not applied "
                             "in combine; pass expert_out=None", fn)
                expert_out = None
            pe = (self._payload_in(expert_out, handle.recv_rows, fn, "expert_out")
                  if expert_out is not None else None)
            if grad_expert_out is None:
                grad_expert_out = empty((handle.recv_rows, self.hidden), self.np_dtype)
            pge = _ptr(grad_expert_out, fn, "grad_expert_out", self._payload,
                       (handle.recv_rows, self.hidden), align=PAYLOAD_ALIGNMENT, writable=True)
        self._combine_backward(handle, pg, pe, pge, gw.ctypes.data if gw is not None else None)
        return grad_expert_out, gw

    def weights_backward(self, handle, grad_recv_w, *, grad_w=None):
        """grad_recv_w (the shape of Handle.recv_routing's recv_w: [N], or
        [N, K] for rank-major) -> grad_w [T, K] (epx_weights_backward,
        collective): the gradient of weights the expert applied itself,
        brought home to each route's source slot (0 for slots without one)."""
        fn = "Buffer.weights_backward"
        with self._together("weights_backward", handle):
            self._host(fn)
            shape = ((handle.recv_rows, handle.top_k) if self.layout == Layout.RANK_MAJOR
                     else (handle.recv_rows,))
            pg = _ptr(grad_recv_w, fn, "grad_recv_w", _F32, shape)
            if grad_w is None:
                grad_w = empty((handle.num_tokens, handle.top_k), np.float32)
            pw = _ptr(grad_w, fn, "grad_w", _F32, (handle.num_tokens, handle.top_k), writable=True)
        _check(lib.epx_weights_backward(self._handle_ptr(fn), handle._use(self, fn), pg, pw))
        return grad_w


def _with_placement(comm, comm_ptr, config, placement):
    """(the config to create with, the buffer's Placement or None), where a
    refusal still meets the peers in epx_buffer_create (with a config the
    library refuses locally), so they fail at once, naming this rank."""
    try:
        return _placement_config(config, placement, comm.size)
    except EpxError:
        if comm.size > 1:
            bad = BufferConfig()
            bad.struct_size = 0
            lib.epx_buffer_create(comm_ptr, ctypes.byref(bad), ctypes.byref(ctypes.c_void_p()))
        raise


def _placement_config(config, placement, world_size):
    """A Placement given sets config.placement (kept alive by the buffer);
    a raw address already in the config is read back."""
    fn = "Buffer"
    if placement is None:
        if not config.placement:
            return config, None
        return config, Placement._from_struct(config.placement, int(config.num_experts),
                                              world_size)
    if not isinstance(placement, Placement):
        _invalid("%s: placement is a %s; pass an epx.Placement or None", fn,
                 type(placement).__name__)
    placement._for(fn, "placement", int(config.num_experts), world_size)
    config = config.copy()
    config.placement = ctypes.addressof(placement._struct)
    return config, placement


def _ll_step(fn, rows, num_tokens):
    """(the count a low-latency dispatch reads, as a ctypes int32 or None,
    the step's tokens): num_tokens of the rows, or all of them."""
    if num_tokens is None:
        return None, rows
    step = int(num_tokens)
    if not 0 <= step <= rows:
        _invalid("%s: num_tokens is %d; pass a count in [0, %d] (the rows of topk_idx)", fn, step,
                 rows)
    return ctypes.c_int32(step), step
