"""DeepEP's ``deep_ep.utils``: :class:`EventHandle` and :class:`EventOverlap`
(``from deep_ep.utils import EventHandle, EventOverlap``, as Megatron and
NeMo Automodel import them).

epx.deep_ep runs every call on PyTorch's current stream, so an event only
orders work that a caller moved to another stream; on CPU every call has
finished when it returns and the events are no-ops."""
from typing import Any, Callable, Optional, Tuple

import torch

__all__ = ["EventHandle", "EventOverlap"]


class EventHandle:
    """DeepEP's ``EventHandle()``: a CUDA event recorded on the current stream
    when made (none on a machine without CUDA, where there is nothing to
    wait for)."""

    __slots__ = ("event",)

    def __init__(self, event: Optional["torch.cuda.Event"] = None) -> None:
        if event is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            stream = torch.cuda.current_stream()
            # a stand-in for a stream (epx.megatron.cpu_shim's, Megatron on
            # the CPU) orders nothing on the GPU
            if isinstance(stream, torch.cuda.Stream):
                event = torch.cuda.Event()
                event.record(stream)
        self.event = event

    def current_stream_wait(self) -> None:
        """The current stream waits for the event."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class EventOverlap:
    """DeepEP's ``EventOverlap``: an :class:`EventHandle` (None unless the
    call was asked for one: ``async_finish=True``), the tensors to keep
    alive until it is waited on, a hook run after the wait, and the ``with``
    form (the current stream waits at the end of the block)."""

    def __init__(self, event: Optional[EventHandle] = None,
                 extra_tensors: Optional[Tuple[torch.Tensor]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self._release_handle_by_call = False
        self.hook_after_wait: Optional[Callable] = None

    def current_stream_wait(self, release_handle: bool = False) -> None:
        assert self.event is not None
        self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            self.hook_after_wait()
            self.hook_after_wait = None
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait: Callable) -> None:
        assert self.hook_after_wait is None, "A hook is already registered on this `EventOverlap`"
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False
