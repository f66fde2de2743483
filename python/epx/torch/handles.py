"""Handle tokens: how an epx.Handle travels between custom ops (a 1-element
int64 CPU tensor) and keep_handles."""
import itertools
import threading
import weakref

import numpy as _np
import torch as _torch

from epx import Status
from epx.errors import _refuse


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


def _handle_id(token):
    """The id a token holds (read from its host memory: a token never lives
    on a device)."""
    return int(token.numpy()[0])


def _handle_of(token, fn):
    h = _HANDLES.get(_handle_id(token))
    if h is None or h.released:
        _refuse(Status.ERROR_INVALID_HANDLE, "%s: the dispatch's handle was released; keep "
                "the Dispatched result (or the autograd graph) alive until combine and "
                "backward have run", fn)
    return h
