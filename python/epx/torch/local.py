"""W ranks on one GPU: run_local runs an EP layer's W ranks as threads of
this process over the local transport (epx.run_local), on the CPU or all on
one CUDA device, so an EP=8 layer's forward and backward can be checked on
one GPU (README, "EP on one GPU"; include/epx.h, the local transport)."""
import numbers
import os
import warnings

import torch as _torch

import epx as _epx
from epx import Status
from epx.errors import _invalid, _refuse

_FN = "epx.torch.run_local"
# CUDA's hardware queues per device when CUDA_DEVICE_MAX_CONNECTIONS is unset
# (CUDA C Programming Guide, environment variables), and its largest value.
_CUDA_CONNECTIONS_DEFAULT, _CUDA_CONNECTIONS_MAX = 8, 32


def _device_of(device):
    try:
        dev = _torch.device(device)
    except (TypeError, RuntimeError, ValueError):
        _invalid("%s: device %r is not a torch device; use \"cpu\" or \"cuda\" (\"cuda:N\")",
                 _FN, device)
    if dev.type not in ("cpu", "cuda"):
        _invalid("%s: device %r: the ranks run on \"cpu\" or on one \"cuda\" device", _FN, device)
    return dev


def _connections(value, when):
    try:
        n = int(value)
    except ValueError:
        _invalid("%s: CUDA_DEVICE_MAX_CONNECTIONS=%r %s is not a number; set it to the rank "
                 "count (1 to %d)", _FN, value, when, _CUDA_CONNECTIONS_MAX)
    return n


def _cuda_environment(world_size, dev):
    """The environment the W-rank CUDA paths need, set before CUDA starts
    (include/epx.h): CUDA_MODULE_LOADING=EAGER (else the fused path is
    refused for ranks sharing a GPU and the host path serves) and
    CUDA_DEVICE_MAX_CONNECTIONS >= W (else the ranks' fused kernels share
    hardware queues and may not be co-resident). Before CUDA starts the
    unset ones are set; after, what CUDA started with is checked."""
    if not _epx.has_cuda():
        _refuse(Status.ERROR_UNSUPPORTED, "%s: device %s needs a libepx built with "
                "EPX_BUILD_CUDA (this one, %s, has no CUDA); use device=\"cpu\"", _FN, dev,
                _epx.library_path)
    if not _torch.cuda.is_available():
        _refuse(Status.ERROR_UNSUPPORTED, "%s: device %s: torch sees no CUDA device (torch %s); "
                "use device=\"cpu\"", _FN, dev, _torch.__version__)
    if dev.index is not None and not 0 <= dev.index < _torch.cuda.device_count():
        _invalid("%s: device %s: torch sees %d CUDA device(s)", _FN, dev,
                 _torch.cuda.device_count())
    loading = os.environ.get("CUDA_MODULE_LOADING")
    conns = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if not _torch.cuda.is_initialized():
        if conns is not None and _connections(conns, "in the environment") < world_size:
            _invalid("%s: CUDA_DEVICE_MAX_CONNECTIONS=%s is less than the %d ranks sharing the "
                     "GPU; set it to at least %d (or unset it: run_local sets it before CUDA "
                     "starts)", _FN, conns, world_size, world_size)
        if conns is None and world_size > _CUDA_CONNECTIONS_DEFAULT:
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(min(world_size, _CUDA_CONNECTIONS_MAX))
        if loading is None:  # torch would set LAZY at its CUDA start
            os.environ["CUDA_MODULE_LOADING"] = "EAGER"
        _torch.cuda.init()  # here, once, not raced by the rank threads
        return
    # CUDA started before this call: its environment is the one it read.
    if loading != "EAGER":
        warnings.warn("%s: CUDA started in this process with CUDA_MODULE_LOADING=%s, not "
                      "EAGER: the fused path is refused for ranks sharing a GPU and the host "
                      "path serves (the same bits). To test the fused path set "
                      "CUDA_MODULE_LOADING=EAGER before CUDA starts (in the shell, or call "
                      "epx.torch.run_local before any other torch.cuda call)"
                      % (_FN, loading), RuntimeWarning, stacklevel=3)
        return  # the host path does not spin on the GPU: any queue count serves it
    have = (_CUDA_CONNECTIONS_DEFAULT if conns is None
            else _connections(conns, "(with which CUDA started)"))
    if have < world_size:
        _invalid("%s: CUDA started in this process with CUDA_DEVICE_MAX_CONNECTIONS=%s, fewer "
                 "hardware queues than the %d ranks sharing the GPU (their fused kernels wait "
                 "on each other and must all be resident); set CUDA_DEVICE_MAX_CONNECTIONS=%d "
                 "in the environment before CUDA starts (in the shell, or call "
                 "epx.torch.run_local before any other torch.cuda call)", _FN,
                 conns if conns is not None else "unset (%d)" % have, world_size,
                 world_size)


def run_local(world_size, fn, *args, device="cpu", timeout_seconds=None, **kwargs):
    """Runs ``fn(comm, *args, **kwargs)`` on `world_size` ranks, threads of
    this process over a local comm (:func:`epx.run_local`), and returns the
    results by rank.

    device="cpu" (the default) is epx.run_local. device="cuda" ("cuda:N", a
    torch.device) puts every rank on that one GPU: for testing an EP=8
    layer's real GPU code (forward and backward, every W-rank CUDA path) on
    one GPU, not for speed (the ranks share its SMs and memory). On each
    rank's thread, fn runs with

    - ``torch.cuda.set_device(device)`` and a torch CUDA stream of its own
      made current (``torch.cuda.stream``), so buffers made in fn
      (:func:`make_buffer`, :class:`MoE`, :class:`TokenDispatcher` with
      device=device) and every op on them run on the rank's stream;
    - multithreaded autograd off (``torch.autograd.set_multithreading_enabled``):
      ``backward()`` runs the graph on the rank's own thread. With it on,
      PyTorch runs every rank's CUDA backward nodes on one engine thread per
      GPU, where one rank's collective would wait for peers queued behind it.

    The environment is set before CUDA starts if this call starts it:
    CUDA_MODULE_LOADING=EAGER unless set (the fused path needs it; with
    another value it is refused and the host path serves, with a
    RuntimeWarning if CUDA had already started so) and
    CUDA_DEVICE_MAX_CONNECTIONS to W when unset and W > 8 (CUDA's default
    is 8). A CUDA_DEVICE_MAX_CONNECTIONS below W is an InvalidArgumentError
    naming the variable. Inside fn keep device-wide waits
    (torch.cuda.synchronize, torch.cuda.empty_cache) off a rank's thread
    while peers may be inside a collective call it has not reached; a
    tensor's ``.cpu()`` or a stream's synchronize is fine.

    timeout_seconds bounds a wait on peers (the comm's default when None):
    a rank that raises makes its peers time out, and the lowest rank's own
    error is raised once every thread has finished. device and
    timeout_seconds are run_local's own: give fn a device of its own
    positionally (``run_local(8, step, problem, "cuda", device="cuda")``).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) \
            or world_size < 1:
        _invalid("%s: world_size is %r; it is the rank count, an int >= 1", _FN, world_size)
    world_size = int(world_size)
    if not callable(fn):
        _invalid("%s: fn is %r, not callable; it is called as fn(comm, *args, **kwargs)",
                 _FN, fn)
    if timeout_seconds is not None and (isinstance(timeout_seconds, bool) or
                                        not isinstance(timeout_seconds, numbers.Real)
                                        or not timeout_seconds > 0):
        _invalid("%s: timeout_seconds is %r; it is a number of seconds > 0, or None (the "
                 "comm's default)", _FN, timeout_seconds)
    dev = _device_of(device)
    if dev.type == "cpu":
        return _epx.run_local(world_size, fn, *args, timeout_seconds=timeout_seconds, **kwargs)
    _cuda_environment(world_size, dev)
    index = dev.index if dev.index is not None else _torch.cuda.current_device()
    dev = _torch.device("cuda", index)

    def rank_fn(comm, *a, **kw):
        _torch.cuda.set_device(dev)
        stream = _torch.cuda.Stream(device=dev)
        try:
            with _torch.cuda.stream(stream), _torch.autograd.set_multithreading_enabled(False):
                return fn(comm, *a, **kw)
        finally:
            # The rank's work is done before its comm closes (run_local
            # closes the comm's buffers when fn returns).
            stream.synchronize()

    return _epx.run_local(world_size, rank_fn, *args, timeout_seconds=timeout_seconds, **kwargs)
