"""The core under the framework drop-ins (epx.megatron, epx.deepspeed,
epx.nemo): the epx comm of a framework's process group, the one buffer
cache (buffers made at their first dispatch, sized for every rank's
tokens), and the exact-size dispatch whose weights the experts apply."""
import threading

import numpy as np

import epx as _epx
import epx.torch as _et
from epx import Weighting


def comm_of(group, timeout_seconds=None):
    """An epx.Comm over the ranks of a torch process group (collective): a
    comm of its own for one rank (no launcher needed), else
    epx.torch.comm_from_process_group's."""
    if group.size() == 1:
        return _epx.Comm.create_self()
    return _et.comm_from_process_group(group, timeout_seconds=timeout_seconds)


def first_buffer(comm, x, max_tokens_per_rank, **fields):
    """The buffer of a drop-in's first dispatch of x [T, H] (collective):
    sized for the most tokens any rank gives now, or max_tokens_per_rank
    if more (the buffer's dropin_max_tokens attribute)."""
    T, H = x.shape
    most = max(int(comm.allgather(np.array([T], dtype=np.int64)).max()), max_tokens_per_rank or 0)
    b = _et.make_buffer(comm, hidden=H, max_tokens_per_rank=most, dtype=x.dtype,
                        device=x.device, **fields)
    b.dropin_max_tokens = most
    return b


def check_tokens(fn, b, x, fix):
    """x [T, H] against the buffer's tokens, hidden size and dtype; fix says
    how to size the buffer for more."""
    T, H = x.shape
    if T > b.dropin_max_tokens or (_et.epx_dtype(x.dtype), H) != (b.dtype, b.hidden):
        _epx._invalid("%s: tokens [%d, %d] %s but the buffer was made for up to %d tokens a rank "
                      "of hidden %d, %s; %s", fn, T, H, x.dtype, b.dropin_max_tokens, b.hidden,
                      _et.torch_dtype(b.dtype), fix % T)


class BufferCache:
    """A drop-in's buffers, one per key (None: one for the owner's life),
    each made collectively at the first dispatch of its key and checked
    against every later one. fn names the drop-in in errors; fix says how
    to size a buffer for more tokens (formatted with the tokens asked)."""

    def __init__(self, fn, fix):
        self.fn, self.fix = fn, fix
        self._buffers = {}
        self._lock = threading.Lock()

    def get(self, comm, x, max_tokens_per_rank, key=None, **fields):
        """The buffer of key for x [T, H] (made now, collectively, if new)."""
        with self._lock:
            b = self._buffers.get(key)
        if b is None:  # made outside the lock: a collective over the comm
            b = first_buffer(comm, x, max_tokens_per_rank, **fields)
            with self._lock:
                b = self._buffers.setdefault(key, b)
        check_tokens(self.fn, b, x, self.fix)
        return b

    def only(self):
        """The buffer of key None, or None before the first dispatch."""
        return self._buffers.get(None)

    def close(self):
        """Closes every buffer made (not collective)."""
        with self._lock:
            buffers = list(self._buffers.values())
            self._buffers.clear()
        for b in buffers:
            b.close()


def dispatch(buffer, x, topk_idx, topk_w, weighting=Weighting.NONE):
    """The drop-ins' dispatch: exact-size outputs (the frameworks' experts
    take the received rows only), the weights applied by the experts unless
    weighting says otherwise."""
    return _et.dispatch(buffer, x, topk_idx, topk_w, weighting=weighting, exact_size=True)
