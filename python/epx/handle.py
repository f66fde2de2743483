"""What a dispatch leaves behind: Handle (one dispatch's layout, which
combine and the backward passes read), Recorder (handles recorded for
replay in a recompute), and their statistics."""
import ctypes
from dataclasses import dataclass

import numpy as np

from . import _lib
from ._lib import Layout, lib, RecorderMode, Status
from .arrays import empty
from .errors import _check, _refuse
from .ownership import _Closable, _RECORDERS, _register, _released


@dataclass(frozen=True)
class HandleStats:
    """epx_handle_stats_t: rows and bytes this rank sends to / receives from
    other ranks in dispatch (self excluded), and the rows it sends itself."""
    send_rows: int
    recv_rows: int
    send_bytes: int
    recv_bytes: int
    local_rows: int


@dataclass(frozen=True)
class RecorderStats:
    """epx_recorder_stats_t."""
    records: int
    replays: int
    fallbacks: int
    bytes_held: int
    bytes_avoided: int


class Handle:
    """The layout of one dispatch (epx_handle_t; one reference of it). It
    drives dispatch, combine and both backward passes on its buffer.
    release()/close() drops the reference; using it afterwards raises
    EpxError EPX_ERROR_INVALID_HANDLE. Closing the buffer releases it too."""

    _autograd = False  # epx.torch: an autograd graph may still replay it (Buffer.close refuses)

    def __init__(self, buffer, ptr, num_tokens, top_k, weighting):
        self._ptr = ptr
        self.buffer = buffer
        self.num_tokens = num_tokens
        self.top_k = top_k
        self.weighting = weighting
        with buffer._lock:
            buffer._handles.add(self)

    def _use(self, buffer, fn):
        if self._ptr is None:
            _released(fn, "handle", "released (or its buffer closed); keep the Handle open, or "
                      "retain() it, while you still need it")
        if buffer is not None and buffer is not self.buffer:
            _refuse(Status.ERROR_INVALID_HANDLE, "%s: the handle belongs to another buffer; pass "
                    "the buffer its dispatch_layout was called on", fn)
        return self._ptr

    @property
    def released(self):
        return self._ptr is None

    closed = released

    def release(self):
        """Drops this reference (epx_handle_release). Releasing twice does nothing."""
        with self.buffer._lock:
            ptr, self._ptr = self._ptr, None
        if ptr is not None:
            _check(lib.epx_handle_release(ptr))

    close = release

    def retain(self):
        """Another reference to the same layout (epx_handle_retain), released separately."""
        ptr = self._use(None, "Handle.retain")
        _check(lib.epx_handle_retain(ptr))
        return Handle(self.buffer, ptr, self.num_tokens, self.top_k, self.weighting)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass

    def __repr__(self):
        if self._ptr is None:
            return "<epx.Handle released>"
        return "<epx.Handle T=%d K=%d N=%d %s>" % (self.num_tokens, self.top_k, self.recv_rows,
                                                   self.weighting.name)

    _recv_rows = None  # N once read (it never changes; on CUDA a read may wait)
    _counts_host = None  # epx.torch: (host counts, event or None) of an exact-size dispatch

    @property
    def recv_rows(self):
        """Row count N of the receive layout (read once: on CUDA with
        worst_case_sizing the read waits for the stream)."""
        ptr = self._use(None, "Handle.recv_rows")
        if self._recv_rows is None:
            v = ctypes.c_int64()
            _check(lib.epx_handle_recv_rows(ptr, ctypes.byref(v)))
            self._recv_rows = v.value
        return self._recv_rows

    def _host(self, fn):
        self.buffer._host(fn)
        return self._use(None, fn)

    def expert_counts(self):
        """(counts [E_local] int64, offsets [E_local + 1] int64): rows per
        local expert before padding, and each group's first row."""
        ptr = self._host("Handle.expert_counts")
        n = self.buffer.experts_per_rank
        counts, offsets = empty((n,), np.int64), empty((n + 1,), np.int64)
        _check(lib.epx_handle_expert_counts(ptr, counts.ctypes.data, offsets.ctypes.data))
        return counts, offsets

    def recv_routing(self):
        """(recv_expert int32, recv_w float32) of each received row: [N] for
        the expert-major and capacity layouts, [N, K] for rank-major."""
        ptr = self._host("Handle.recv_routing")
        n = self.recv_rows
        shape = (n, self.top_k) if self.buffer.layout == Layout.RANK_MAJOR else (n,)
        expert, w = empty(shape, np.int32), empty(shape, np.float32)
        _check(lib.epx_handle_recv_routing(ptr, expert.ctypes.data, w.ctypes.data))
        return expert, w

    def recv_source(self):
        """(src_rank [N] int32, src_token [N] int32) of each received row (-1 for padding)."""
        ptr = self._host("Handle.recv_source")
        n = self.recv_rows
        rank, token = empty((n,), np.int32), empty((n,), np.int32)
        _check(lib.epx_handle_recv_source(ptr, rank.ctypes.data, token.ctypes.data))
        return rank, token

    def stats(self):
        """:class:`HandleStats` of the dispatch."""
        s = _lib.HandleStatsStruct()
        _check(lib.epx_handle_stats(self._use(None, "Handle.stats"), ctypes.byref(s)))
        return HandleStats(s.send_rows, s.recv_rows, s.send_bytes, s.recv_bytes, s.local_rows)


class Recorder(_Closable):
    """Activation-checkpoint recorder (epx_recorder_t): in RECORD mode each
    dispatch_layout given it is logged; in REPLAY mode each one returns the
    next recorded handle with no exchange. validate: replays hash the routing
    and refuse a difference (EPX_ERROR_REPLAY_MISMATCH, collective)."""

    def __init__(self, validate=True):
        p = ctypes.c_void_p()
        _check(lib.epx_recorder_create(1 if validate else 0, ctypes.byref(p)))
        self._ptr = p.value
        self.validate = bool(validate)
        self.mode = RecorderMode.RECORD
        self._buffers = set()  # strong: the recorded handles keep these buffers busy
        self.id = _register(_RECORDERS, self)

    def _handle_ptr(self, fn):
        if self._ptr is None:
            _released(fn, "recorder", "closed; create a new one")
        return self._ptr

    def set_mode(self, mode):
        """RecorderMode.RECORD or REPLAY (switching to replay rewinds)."""
        _check(lib.epx_recorder_set_mode(self._handle_ptr("Recorder.set_mode"), int(mode)))
        self.mode = RecorderMode(mode)
        return self

    def record(self):
        return self.set_mode(RecorderMode.RECORD)

    def replay(self):
        return self.set_mode(RecorderMode.REPLAY)

    def stats(self):
        s = _lib.RecorderStatsStruct()
        _check(lib.epx_recorder_stats(self._handle_ptr("Recorder.stats"), ctypes.byref(s)))
        return RecorderStats(s.records, s.replays, s.fallbacks, s.bytes_held, s.bytes_avoided)

    def close(self):
        """Releases every handle it holds (epx_recorder_destroy)."""
        ptr, self._ptr = self._ptr, None
        if ptr is not None:
            self._buffers.clear()
            _check(lib.epx_recorder_destroy(ptr))

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
