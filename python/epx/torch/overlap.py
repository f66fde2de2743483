"""Overlap: ops on a communication stream, ordered by events (DeepEP's
EventOverlap, current_event)."""
import torch as _torch
from torch import Tensor

from epx.errors import _invalid


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
            _invalid("%s: comm_stream is given but the tensors are on %s; streams are for "
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
