"""Profiler ranges and call statistics: every epx op is a torch.profiler
range and, on CUDA, an NVTX range of the same name, counted in stats()."""
import contextlib
import functools
import threading
import time

import torch as _torch
from torch import Tensor


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
