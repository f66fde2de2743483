"""The core under the framework drop-ins (epx.megatron, epx.deepspeed,
epx.nemo): the epx comm of a framework's process group, the one buffer
cache (buffers made at their first dispatch, sized for every rank's
tokens), and the exact-size dispatch whose weights the experts apply."""
import threading

import numpy as np

import epx as _epx
import epx.torch as _et
from epx import Status, Weighting


def comm_of(group, timeout_seconds=None):
    """An epx.Comm over the ranks of a torch process group (collective): a
    comm of its own for one rank (no launcher needed), else
    epx.torch.comm_from_process_group's."""
    if group.size() == 1:
        return _epx.Comm.create_self()
    return _et.comm_from_process_group(group, timeout_seconds=timeout_seconds)


def _most_tokens(comm, x):
    """The most tokens any rank gives now (collective)."""
    return int(comm.allgather(np.array([x.shape[0]], dtype=np.int64)).max())


def _make(comm, x, tokens, fields):
    b = _et.make_buffer(comm, hidden=x.shape[1], max_tokens_per_rank=tokens, dtype=x.dtype,
                        device=x.device, **fields)
    b.dropin_max_tokens = tokens
    return b


def first_buffer(comm, x, max_tokens_per_rank, **fields):
    """The buffer of a drop-in's first dispatch of x [T, H] (collective):
    sized for the most tokens any rank gives now, or max_tokens_per_rank
    if more (the buffer's dropin_max_tokens attribute); at least one token
    (a first batch empty on every rank sizes nothing: 0 would be a buffer
    without a size)."""
    most = max(_most_tokens(comm, x), max_tokens_per_rank or 0, 1)
    return _make(comm, x, most, fields)


def check_tokens(fn, b, x):
    """x [T, H] against the buffer's hidden size and dtype (its token count
    is the library's to check: epx_dispatch_layout refuses an oversize
    batch on every rank together, where a check here would refuse it on one
    rank and leave the others waiting)."""
    T, H = x.shape
    if (_et.epx_dtype(x.dtype), H) != (b.dtype, b.hidden):
        _epx._invalid("%s: tokens [%d, %d] %s but the buffer was made for hidden %d, %s; pass "
                      "the hidden size and dtype of the layer's first call", fn, T, H, x.dtype,
                      b.hidden, _et.torch_dtype(b.dtype))


class BufferCache:
    """A drop-in's buffers, one per key (None: one for the owner's life),
    each made collectively at the first dispatch of its key.

    Size: with max_tokens_per_rank (the drop-in's setting) a buffer holds
    that many tokens a rank (or the first batch's most, if more), and a
    larger batch is refused with fix (formatted with the tokens asked: how
    to set it in the drop-in's own terms). Without it, the buffer grows:
    epx_dispatch_layout refuses an oversize batch on every rank together
    (CapacityExceededError, nothing moved), so every rank then agrees the
    new size (the most tokens of any rank, at least double the old) and
    makes the larger buffer together, and the dispatch runs again. Never a
    rank-local resize. An outgrown buffer stays open while its handles are
    alive (a backward replays them) and is closed once they are gone."""

    def __init__(self, fn, fix):
        self.fn, self.fix = fn, fix
        self._buffers = {}
        self._outgrown = []
        self._lock = threading.Lock()

    def get(self, comm, x, max_tokens_per_rank, key=None, **fields):
        """The buffer of key for x [T, H] (made now, collectively, if new)."""
        with self._lock:
            b = self._buffers.get(key)
        if b is None:  # made outside the lock: a collective over the comm
            b = first_buffer(comm, x, max_tokens_per_rank, **fields)
            with self._lock:
                b = self._buffers.setdefault(key, b)
        check_tokens(self.fn, b, x)
        return b

    def dispatch(self, comm, x, topk_idx, topk_w, max_tokens_per_rank, key=None,
                 weighting=Weighting.NONE, **fields):
        """The drop-in's dispatch of x [T, H] on the buffer of key
        (collective), grown as the class says when max_tokens_per_rank is
        None."""
        b = self.get(comm, x, max_tokens_per_rank, key, **fields)
        try:
            return dispatch(b, x, topk_idx, topk_w, weighting)
        except _epx.CapacityExceededError as e:
            refused = e.with_traceback(None)  # (its frames would keep this call's tensors)
        # Every rank is here: the layout refused the batch on all of them.
        # (Outside the except block: closing an outgrown buffer there would
        # turn its BusyError into a note on the refusal.)
        most = _most_tokens(comm, x)
        if most <= b.dropin_max_tokens:
            raise refused
        if max_tokens_per_rank is not None:
            _epx._refuse(Status.ERROR_CAPACITY_EXCEEDED, "%s: a rank has %d tokens, above the "
                         "%d tokens a rank its buffer was made for; %s", self.fn, most,
                         b.dropin_max_tokens, self.fix % most)
        b = self._grow(comm, x, key, b, max(most, 2 * b.dropin_max_tokens), fields)
        return dispatch(b, x, topk_idx, topk_w, weighting)

    def _grow(self, comm, x, key, old, tokens, fields):
        b = _make(comm, x, tokens, fields)
        with self._lock:
            self._buffers[key] = b
            self._outgrown.append(old)
        self._close_outgrown()
        return b

    def _close_outgrown(self):
        """Closes the outgrown buffers whose handles are gone."""
        with self._lock:
            outgrown, self._outgrown = self._outgrown, []
        kept = [b for b in outgrown if not _closed(b)]
        with self._lock:
            self._outgrown.extend(kept)

    def only(self):
        """The buffer of key None, or None before the first dispatch."""
        return self._buffers.get(None)

    def close(self):
        """Closes every buffer made (not collective). One still in use (its
        BusyError) stays here, so a later close() closes it; the first such
        error is raised once every other buffer is closed."""
        with self._lock:
            items = list(self._buffers.items())
        failed = None
        for key, b in items:
            try:
                b.close()
            except _epx.EpxError as e:
                failed = failed or e
            if not b.closed:  # (closed inside an except block, BUSY is a note: kept too)
                continue
            with self._lock:
                if self._buffers.get(key) is b:
                    del self._buffers[key]
        self._close_outgrown()
        with self._lock:
            busy = self._outgrown and not failed
        if busy:
            self._outgrown[0].close()  # raises its BusyError, with the fix
        if failed is not None:
            raise failed


def _closed(b):
    """Closes b unless a handle still needs it; whether it closed."""
    try:
        b.close()
    except _epx.BusyError:
        pass
    return b.closed


def dispatch(buffer, x, topk_idx, topk_w, weighting=Weighting.NONE):
    """The drop-ins' dispatch: exact-size outputs (the frameworks' experts
    take the received rows only), the weights applied by the experts unless
    weighting says otherwise."""
    return _et.dispatch(buffer, x, topk_idx, topk_w, weighting=weighting, exact_size=True)
