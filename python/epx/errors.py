"""The errors of libepx as Python exceptions: EpxError and one subclass per
status (each also a subclass of the matching builtin), and the helpers that
raise them (_check on a status, _invalid / _refuse with the binding's words)."""
from . import _lib
from ._lib import lib, Status


class EpxError(RuntimeError):
    """A call that did not return EPX_SUCCESS.

    ``status`` is the :class:`Status`, ``status_name`` its C name
    ("EPX_ERROR_TIMEOUT") and ``message`` the library's epx_last_error() (or,
    for a check made in Python before the call, a message in the same form:
    the function, the argument, the fix; ``in_library`` tells which). Nothing
    the caller owns was changed.

    Each status raises its own subclass (:class:`InvalidArgumentError`,
    :class:`TimeoutError`, ...), which also derives from the built-in
    exception that fits (ValueError, MemoryError, TimeoutError, ...), so
    ``except ValueError`` catches a bad argument. ``EpxError(status, msg)``
    itself builds the subclass of that status.
    """

    def __new__(cls, status=Status.ERROR_INTERNAL, message="", in_library=False):
        if cls is EpxError:
            cls = _ERROR_CLASSES.get(int(status), EpxError)
        # The __new__ of the built-in whose memory layout the class has
        # (OSError's for TimeoutError and ConnectionError).
        solid = max((b for b in cls.__mro__ if b.__module__ == "builtins"),
                    key=lambda b: b.__basicsize__)
        return solid.__new__(cls)

    def __init__(self, status, message, in_library=False):
        self.in_library = in_library  # False: refused by a check made in Python
        try:
            self.status = Status(status)
            self.status_name = "EPX_" + self.status.name
        except ValueError:
            self.status = int(status)
            self.status_name = lib.epx_status_string(int(status)).decode()
        self.message = message
        RuntimeError.__init__(self, "%s: %s" % (self.status_name, message))

    def __str__(self):
        return "%s: %s" % (self.status_name, self.message)

    def __reduce__(self):
        return (EpxError, (int(self.status), self.message, self.in_library))


_ERROR_CLASSES = {}


def _error_class(name, status, builtin, doc):
    """The EpxError subclass of one status (also a `builtin` when not None)."""
    bases = (EpxError,) if builtin is None else (EpxError, builtin)
    cls = type(name, bases, {"__doc__": doc, "__module__": __name__, "__new__": EpxError.__new__})
    _ERROR_CLASSES[int(status)] = cls
    return cls


InvalidArgumentError = _error_class("InvalidArgumentError", Status.ERROR_INVALID_ARGUMENT,
                                    ValueError, "EPX_ERROR_INVALID_ARGUMENT (a ValueError).")
OutOfMemoryError = _error_class("OutOfMemoryError", Status.ERROR_OUT_OF_MEMORY, MemoryError,
                                "EPX_ERROR_OUT_OF_MEMORY (a MemoryError).")
UnsupportedError = _error_class("UnsupportedError", Status.ERROR_UNSUPPORTED, NotImplementedError,
                                "EPX_ERROR_UNSUPPORTED (a NotImplementedError): this build or "
                                "this device cannot do it.")
CapacityExceededError = _error_class("CapacityExceededError", Status.ERROR_CAPACITY_EXCEEDED,
                                     ValueError, "EPX_ERROR_CAPACITY_EXCEEDED (a ValueError): "
                                     "more tokens or rows than the buffer holds.")
ShapeMismatchError = _error_class("ShapeMismatchError", Status.ERROR_SHAPE_MISMATCH, ValueError,
                                  "EPX_ERROR_SHAPE_MISMATCH (a ValueError): ranks disagree.")
InvalidHandleError = _error_class("InvalidHandleError", Status.ERROR_INVALID_HANDLE, ValueError,
                                  "EPX_ERROR_INVALID_HANDLE (a ValueError): a released or "
                                  "foreign object.")
BusyError = _error_class("BusyError", Status.ERROR_BUSY, None,
                         "EPX_ERROR_BUSY: the object is still in use (handles alive).")
TimeoutError = _error_class("TimeoutError", Status.ERROR_TIMEOUT, TimeoutError,  # noqa: A001
                            "EPX_ERROR_TIMEOUT (also the built-in TimeoutError): a peer did not "
                            "answer in time.")
PeerFailedError = _error_class("PeerFailedError", Status.ERROR_PEER_FAILED, ConnectionError,
                               "EPX_ERROR_PEER_FAILED (a ConnectionError): another rank failed.")
TransportError = _error_class("TransportError", Status.ERROR_TRANSPORT, ConnectionError,
                              "EPX_ERROR_TRANSPORT (a ConnectionError): MPI or NCCL failed.")
ReplayMismatchError = _error_class("ReplayMismatchError", Status.ERROR_REPLAY_MISMATCH,
                                   ValueError, "EPX_ERROR_REPLAY_MISMATCH (a ValueError): a "
                                   "recompute routed differently from its record.")
CudaError = _error_class("CudaError", Status.ERROR_CUDA, None, "EPX_ERROR_CUDA.")
InternalError = _error_class("InternalError", Status.ERROR_INTERNAL, None, "EPX_ERROR_INTERNAL.")


def _check(status):
    if status != 0:
        # The message first: it is valid until this thread's next epx call.
        message = lib.epx_last_error().decode("utf-8", "replace")
        raise EpxError(status, message, in_library=True)


def _refuse(status, fmt, *args):
    raise EpxError(status, fmt % args if args else fmt)


def _invalid(fmt, *args):
    _refuse(Status.ERROR_INVALID_ARGUMENT, fmt, *args)


_lib.refuse_invalid = _invalid  # config fields out of their C range: an InvalidArgumentError


def _c_int(value, ctype, fn, name):
    """value as the int a C parameter of ctype (ctypes.c_int32, c_int64)
    gets, refused by name when outside its range (ctypes would wrap it:
    2**32 + 1 ranks are 1)."""
    _lib.check_int_range(value, ctype, "%s: %s" % (fn, name))
    return int(value)
