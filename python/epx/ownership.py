"""What every C object of the binding shares: ids for the custom ops
(_BUFFERS, _RECORDERS), close() and the context manager (_Closable), and
the order of release (children before parents)."""
import contextlib
import itertools
import sys
import weakref

from ._lib import lib, Status
from .errors import _check, _refuse


# ---------------------------------------------------------------------------
# Objects: ownership and the order of release
# ---------------------------------------------------------------------------
#
# A child holds a strong reference to its parent (Handle -> Buffer -> Comm ->
# LocalWorld; a Recorder -> the Buffers it recorded on), so garbage collection
# can never free a parent before its children; a parent keeps weak references
# to its children so that close() can release them first.


# Buffers and recorders by a small integer id (their `id` attribute): what
# epx.torch's custom ops take in place of the object (an op's arguments are
# tensors and numbers). Weak: the id does not keep the object alive.
_BUFFERS = weakref.WeakValueDictionary()
_RECORDERS = weakref.WeakValueDictionary()
_next_id = itertools.count(1)


def _register(table, obj):
    i = next(_next_id)
    table[i] = obj
    return i


def _released(fn, what, fix):
    _refuse(Status.ERROR_INVALID_HANDLE, "%s: the %s was %s", fn, what, fix)


class _Closable:
    """A library object that close() releases: a context manager, with
    `closed` telling whether it has been."""

    @property
    def closed(self):
        return self._ptr is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _busy(message):
    """EPX_ERROR_BUSY from a close(), unless an exception is already
    propagating through that close (a ``finally`` block, a ``with`` exit, an
    ``except`` block): raising would replace it, so the message becomes a
    note on it instead, and the object stays open (to be closed later, or by
    garbage collection)."""
    unwinding = sys.exc_info()[1]
    if unwinding is None:
        _refuse(Status.ERROR_BUSY, message)
    if hasattr(unwinding, "add_note"):
        unwinding.add_note("(epx: EPX_ERROR_BUSY: %s; it stays open)" % message)


def _destroy(obj, destroy, lock=None):
    """Destroys obj's pointer with destroy(ptr); when the library answers
    EPX_ERROR_BUSY the object stays open (and the error is raised, see
    _busy)."""
    with lock if lock is not None else contextlib.nullcontext():
        ptr, obj._ptr = obj._ptr, None
    if ptr is None:
        return
    status = destroy(ptr)
    if status == Status.ERROR_BUSY:
        obj._ptr = ptr
        _busy(lib.epx_last_error().decode("utf-8", "replace"))
        return
    _check(status)
