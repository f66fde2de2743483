"""torch tensors at the binding's edge: the dtype maps (epx_dtype,
torch_dtype) and every argument check of the ops, in the binding's words
(function, argument, fix), plus the buffer lookups the ops share."""
import torch as _torch

import epx as _epx
from epx import Device, DType, Status
from epx.arrays import _as_dtype, _shape_text
from epx.errors import _invalid, _refuse
from epx.ownership import _BUFFERS
from epx import semantics


_DTYPES = {_torch.float32: DType.FLOAT32, _torch.bfloat16: DType.BFLOAT16,
           _torch.float16: DType.FLOAT16}
_TORCH_OF = {v: k for k, v in _DTYPES.items()}
_I32, _I64, _F32 = _torch.int32, _torch.int64, _torch.float32
# epx.semantics' dtype names ("payload" aside); fp8 is None where torch has no e4m3fn.
_OF_NAME = {"float32": _F32, "int32": _I32, "int64": _I64, "uint8": _torch.uint8,
            semantics.FP8: getattr(_torch, "float8_e4m3fn", None)}


def epx_dtype(dtype):
    """The epx DType of a torch dtype (float32, bfloat16, float16), or of
    anything epx accepts as a dtype."""
    return _as_dtype(dtype)


def torch_dtype(dtype):
    """The torch dtype of an epx dtype (or of a torch dtype: itself)."""
    return _TORCH_OF[_as_dtype(dtype)]


def _device_kind(buffer_device):
    return "cuda" if buffer_device == Device.CUDA else "cpu"


def _check_device(t, fn, name, buffer_device):
    want = _device_kind(buffer_device)
    if t.device.type != want:
        if t.device.type == "cuda" and not _epx.has_cuda():
            _refuse(Status.ERROR_UNSUPPORTED, "%s: %s is a CUDA tensor but this libepx (%s) "
                    "has no CUDA backend; build it with -DEPX_BUILD_CUDA=ON (pip install "
                    "./python does when nvcc is found)", fn, name, _epx.library_path)
        _invalid("%s: %s is on %s but the buffer is a %s buffer; move it with .to(%r)", fn,
                 name, t.device, want.upper(), want)


def _tensor(t, fn, name, dtype, shape, buffer_device, align=4, optional=False):
    """A tensor argument made usable by the library: checked for type, dtype,
    shape and device; made contiguous and aligned (copying) when it is not."""
    if t is None:
        if optional:
            return None
        _invalid("%s: %s is None; pass a %s tensor of shape %s", fn, name, dtype,
                 _shape_text(shape))
    if not isinstance(t, _torch.Tensor):
        _invalid("%s: %s is a %s; pass a torch.Tensor", fn, name, type(t).__name__)
    _check_device(t, fn, name, buffer_device)
    if t.dtype != dtype:
        _invalid("%s: %s has dtype %s; pass %s (convert with .to(%s))", fn, name, t.dtype,
                 dtype, dtype)
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        _invalid("%s: %s has shape %s; expected %s", fn, name, list(t.shape),
                 _shape_text(shape))
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() and t.data_ptr() % align:
        t = t.clone()
    return t


def _tensor_args(fn, required, optional):
    """Refuses, by name, an argument that is not a tensor before it reaches
    a custom op (whose own refusal would be torch's schema error), and a
    meta tensor: the op would answer it from its fake function, shapes with
    no exchange, as if it had run. (torch.compile's fake tensors report
    the device they stand for, so tracing passes.)"""
    for name, t in list(required.items()) + list(optional.items()):
        if not isinstance(t, _torch.Tensor) and (t is not None or name in required):
            _invalid("%s: %s is %s; pass a torch.Tensor", fn, name,
                     "None" if t is None else "a " + type(t).__name__)
        if isinstance(t, _torch.Tensor) and t.device.type == "meta":
            _invalid("%s: %s is a meta tensor (shapes, no data): nothing would move; pass a "
                     "tensor on the buffer's device (materialize the module with "
                     "to_empty(device=...) and load its weights first)", fn, name)


def _routing_tensor(t, fn, name, dtype, shape, buffer_device, optional=False, high=None):
    """A routing tensor as the dtype the library reads: weights of any
    numeric dtype; expert ids and locations (dtype int32) of an integer
    dtype, checked in that dtype before the conversion (_ids; high: E for
    ids)."""
    if t is None and optional:
        return None
    if not isinstance(t, _torch.Tensor):
        _tensor(t, fn, name, dtype, shape, buffer_device)
    _check_device(t, fn, name, buffer_device)
    t = t.detach()
    if dtype == _I32:
        t = _ids(t, fn, name, high)
    return _tensor(t.to(dtype), fn, name, dtype, shape, buffer_device)


_INT32_MAX = 2 ** 31 - 1


def _ids(t, fn, name, high):
    """Ids or locations in the caller's dtype, before they become the int32
    the library reads (a cast would send the id 2**32 + 1 to expert 1 and
    1.9 to 1): a non-integer dtype is refused; so is, on the CPU, a value
    outside [-1, high) (high None: int32's range; the library checks
    locations against C itself), naming it. On CUDA reading the values would
    wait for the device, so values are clamped to [-2, INT32_MAX] instead:
    one outside int32 becomes a value the library refuses (with
    worst_case_sizing: drops and reports) as the out-of-range route it is,
    and one inside keeps its value for the library's own check."""
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == _torch.bool:
        _invalid("%s: %s has dtype %s; pass an integer tensor (int32 or int64)", fn, name,
                 t.dtype)
    if t.dtype == _I32 or t.numel() == 0:
        return t
    top = _INT32_MAX if high is None else high - 1
    unsigned = _torch.iinfo(t.dtype).min == 0  # (compared with -1, -1 would become 255)
    if t.device.type == "cuda":
        info = _torch.iinfo(t.dtype)
        low = -2 if info.min < -2 else None
        high_ = _INT32_MAX if info.max > _INT32_MAX else None
        return t if low is None and high_ is None else t.clamp(low, high_)
    # one reduction for the common case (every value in range), the search for
    # the first bad one only when there is one
    lo, hi = _torch.aminmax(t)
    if (unsigned or int(lo) >= -1) and int(hi) <= top:
        return t
    bad = (t > top if unsigned else (t < -1) | (t > top)).nonzero()
    if len(bad):
        at = tuple(int(i) for i in bad[0])
        _invalid("%s: %s%s is %d, outside [-1, %d]; pass %s", fn, name, list(at),
                 int(t[at]), top, "expert ids of the buffer's %d experts (-1: none)" % high
                 if high is not None else "values that fit int32")
    return t


def _host_copy(t):
    """(host tensor, event) for :func:`_host_values`: on CUDA a copy of t to
    pinned memory started now on the current stream and an event after it
    (read once a later wait on the stream has covered it, with no wait of
    its own); elsewhere t itself and no event."""
    if t.device.type != "cuda":
        return t, None
    host = _torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = _torch.cuda.Event()
    done.record()
    return host, done


def _host_values(copy):
    """The numpy values of a :func:`_host_copy`, its event waited for (done
    already where a wait on the stream followed the copy)."""
    host, done = copy
    if done is not None:
        done.synchronize()
    return host.numpy()


def _ptr(t):
    return t.data_ptr() if t is not None and t.numel() else None


def _on_stream(buffer, device):
    """CUDA buffers run on PyTorch's current stream of the tensors' device.
    Changing a buffer's stream orders the new one after the old one (an
    event wait), which a stream being captured into a CUDA graph cannot do
    with an event from outside the capture: refused with the fix."""
    if buffer.device != Device.CUDA:
        return
    stream = _torch.cuda.current_stream(device).cuda_stream
    if stream == buffer.stream:
        return
    if _torch.cuda.is_current_stream_capturing():
        _refuse(Status.ERROR_UNSUPPORTED, "epx.torch: buffer %d gets a new CUDA stream "
                "inside a CUDA graph capture; run a warm-up step on the capture stream "
                "first (with torch.cuda.stream(s): step(); then torch.cuda.graph(g, "
                "stream=s))", buffer.id)
    buffer.set_stream(stream)


def _buffer(buffer_id, fn):
    b = _BUFFERS.get(int(buffer_id))
    if b is None or b.closed:
        _refuse(Status.ERROR_INVALID_HANDLE, "%s: buffer %d was closed (or never made); "
                "keep the epx.Buffer open while the layer uses it", fn, buffer_id)
    return b


def _sized_buffer(buffer, fn):
    """The ops size their receive tensors for the buffer's worst case before
    any exchange (torch.compile's fake tensors need it), so a buffer made
    without max_tokens_per_rank is refused in eager code as in compiled."""
    if not buffer.config.max_tokens_per_rank:
        _invalid("%s: buffer %d was made without max_tokens_per_rank, so its receive size "
                 "is not known before the first exchange; make it with "
                 "epx.torch.make_buffer(..., max_tokens_per_rank=...) (or "
                 "comm.buffer(max_tokens_per_rank=...))", fn, buffer.id)


def _max_rows(buffer, fn):
    """Rows of every receive tensor: the buffer's worst case."""
    try:
        return buffer.max_recv_rows()
    except _epx.EpxError as e:
        _invalid("%s: the buffer's receive size is not known yet (%s); give the buffer "
                 "max_tokens_per_rank (epx.torch.make_buffer / MoE(max_tokens_per_rank=...)) "
                 "so its worst case is known before the first call, as torch.compile needs",
                 fn, e.message)


def _handle_rows(h, b, fn):
    """The fewest rows a tensor of handle h's receive layout must have: N
    where the host knows it (CPU buffers; an exact-size dispatch, which read
    it), else the worst case N_max that dispatch returned (on CUDA N lives on
    the device, and reading it would wait for it)."""
    if b.device == Device.CPU or h._recv_rows is not None:
        return h.recv_rows
    return _max_rows(b, fn)


def _check_handle_rows(rows, h, b, fn, name):
    """A tensor's rows against the handle before any C call: the library
    reads (or writes) N rows of it, so fewer would be out of bounds (and,
    over several ranks, one rank's garbage would reach another's tokens);
    more than any dispatch on the buffer receives is not a recv_x's either."""
    need, most = _handle_rows(h, b, fn), _max_rows(b, fn)
    if not need <= rows <= max(need, most):
        _invalid("%s: %s has %d rows; the dispatch received %d (any dispatch on this buffer "
                 "at most %d): pass a row for every row of the Dispatched's recv_x, as "
                 "dispatch returned it", fn, name, rows, need, most)


def _check_handle_shape(h, fn, num_tokens, top_k=None):
    """The numbers an op got beside its handle (from a Dispatched) against
    the handle's own."""
    if num_tokens != h.num_tokens or (top_k is not None and top_k != h.top_k):
        _invalid("%s: the dispatch had %d tokens and top_k %d, not %d and %s; pass the "
                 "Dispatched that dispatch returned, unchanged", fn, h.num_tokens, h.top_k,
                 num_tokens, top_k if top_k is not None else h.top_k)


def _recv_w_shape(buffer, rows, top_k):
    return semantics.recv_w_shape(buffer.layout, rows, top_k)


def _empties(outs, like, payload=None):
    """Uninitialised tensors of epx.semantics outputs, as a fake function
    returns them: on like's device (host outputs on the CPU), payload ones in
    payload's dtype (default like's)."""
    made = []
    for o in outs:
        dtype = (payload or like.dtype) if o.dtype == semantics.PAYLOAD else _OF_NAME[o.dtype]
        made.append(like.new_empty(o.shape, dtype=dtype) if o.where == "device"
                    else _torch.empty(o.shape, dtype=dtype, device="cpu"))
    return tuple(made)
