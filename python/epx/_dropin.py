"""What the framework drop-ins (epx.megatron, epx.deepspeed, epx.nemo)
share: the epx comm of a framework's process group, and the buffer each
makes at its first dispatch, sized for every rank's tokens."""
import numpy as np

import epx as _epx
import epx.torch as _et


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
    if more (the buffer's max_tokens_per_rank attribute). Later dispatches
    call :func:`check_tokens`."""
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
