"""DeepEP's normal-mode semantics on epx.torch, shared by the V1 ``Buffer``
and the V2 ``ElasticBuffer``.

One epx exchange per DeepEP buffer: the epx comm of its process group and
the epx buffers its dispatches need, one per (hidden, dtype, device,
experts, top-k), in epx's rank-major layout with the dedup exchange (a
token sent once per destination rank, as DeepEP's normal kernels send it):

    recv_x [N, H]        a row per (source rank, source token) that chose at
                         least one of this rank's experts, by source rank
                         then token
    recv_topk_idx [N, K] the row's experts as local ids, -1 elsewhere
    recv_w [N, K]        their weights, 0 elsewhere

combine sums each token's rows over the ranks (no weights applied, as
DeepEP's combine). The small per-token tensors DeepEP's kernels carry beside
the rows (top-k weights at a cached dispatch, the weights combine reduces)
move over the process group with ``all_to_all_single``, in the same order.

In place of a process group an ``epx.Comm`` may be given (threads of
``epx.run_local``, MPI; epx.nemo's groups): its small tensors move with
``Comm.alltoallv``.
"""
import threading

import numpy as np
import torch
import torch.distributed as dist

import epx
import epx.torch as et

topk_idx_t = torch.int64

# What every dispatch did, for the recompute checks (a cached dispatch moves
# no layout): stats(reset=True) clears it.
_STATS = {"layouts": 0, "cached_dispatches": 0, "combines": 0}
_stats_lock = threading.Lock()


def _count(name):
    with _stats_lock:
        _STATS[name] += 1


def stats(reset=False):
    """{"layouts": fresh dispatches (a layout and its count exchange),
    "cached_dispatches": dispatches on a handle (payload only), "combines"}
    since the last reset, in this process."""
    with _stats_lock:
        out = dict(_STATS)
        if reset:
            for k in _STATS:
                _STATS[k] = 0
    return out


_SAC_KINDS = []


def _sac_modes():
    """True when the dispatch modes on the stack are all selective
    checkpointing's (torch.utils.checkpoint's caching and cached modes)."""
    if torch._C._len_torch_dispatch_stack() == 0:
        return False
    if not _SAC_KINDS:
        from torch.utils import checkpoint as cp
        _SAC_KINDS.extend(k for k in (getattr(cp, "_CachingTorchDispatchMode", None),
                                      getattr(cp, "_CachedTorchDispatchMode", None))
                          if k is not None)
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    kinds = tuple(_SAC_KINDS)
    return bool(kinds) and all(isinstance(m, kinds) for m in _get_current_dispatch_mode_stack())


def opaque(f):
    """Runs f as DeepEP's compiled calls run: without autograd (its outputs
    carry none; torch.no_grad only where grad mode is on, as a framework's
    autograd Function calls with it off) and unseen by selective activation
    checkpointing. SAC logs every torch op of the forward and wants the same
    ops in the recompute, but a framework may recompute a layout dispatch as
    a cached one (NeMo Automodel's dispatch replay under apply_ac does):
    DeepEP's C++ calls are invisible to SAC, so epx's ops under them run
    outside its modes too. Other dispatch modes (fake tensors, tracing) stay
    in place."""
    import functools
    from torch.utils._python_dispatch import _disable_current_modes

    @functools.wraps(f)
    def call(*args, **kwargs):
        if _sac_modes():
            with _disable_current_modes():
                return call(*args, **kwargs)
        if torch.is_grad_enabled():
            with torch.no_grad():
                return f(*args, **kwargs)
        return f(*args, **kwargs)
    return call


def unsupported(fn, what):
    """A feature epx does not offer: a NotImplementedError naming it."""
    raise NotImplementedError("epx.deep_ep: %s: %s" % (fn, what))


def comm_stream(fn):
    """The stream epx's calls run on: PyTorch's current CUDA stream (both
    buffers' get_comm_stream; fn names the caller where there is no CUDA)."""
    if not torch.cuda.is_available():
        unsupported(fn, "no CUDA here: epx's CPU calls run on the calling thread and have no "
                    "stream")
    return torch.cuda.current_stream()


def aligned(counts, alignment):
    """Each count rounded up to a multiple of alignment (DeepEP's
    expert_alignment), for tensors and numpy arrays alike."""
    return (counts + alignment - 1) // alignment * alignment


def check(ok, fn, fmt, *args):
    if not ok:
        raise ValueError("epx.deep_ep: %s: %s" % (fn, fmt % args if args else fmt))


def group_of(group, comm, fn):
    """(rank, size, group) of DeepEP's ``group`` (a process group, or an
    epx.Comm) or ``comm`` (an mpi4py communicator)."""
    if isinstance(group, epx.Comm):
        return group.rank, group.size, group
    if group is not None:
        return group.rank(), group.size(), group
    if comm is not None:
        unsupported(fn, "an mpi4py comm in place of a process group; pass the torch.distributed "
                    "group (epx.torch.init_process_group starts one under mpirun)")
    raise ValueError("Either 'group' or 'comm' must be provided.")


_FP8 = getattr(torch, "float8_e4m3fn", None)
_FP8_FORMAT = epx.FP8Format.E4M3_F32_128


def split_x(x, fn):
    """DeepEP's x: a tensor [T, H], or (x_q float8_e4m3fn [T, H], scales
    [T, S] float32 or int32 in any layout: DeepEP's per-128 float32 scales,
    UE8M0 bytes packed four to an int32, MXFP8 scales packed the same way)
    -> (x, scales or None), checked. The scales travel as DeepEP moves
    them: opaque 4-byte values beside each row, received row-major."""
    if isinstance(x, tuple):
        check(len(x) == 2, fn, "x is a tuple of %d; pass (x_fp8, x_scales)", len(x))
        q, s = x
        check(isinstance(q, torch.Tensor) and q.dtype == _FP8 and q.dim() == 2, fn,
              "x[0] must be a [num_tokens, hidden] torch.float8_e4m3fn tensor, not %s",
              getattr(q, "dtype", type(q).__name__))
        check(q.shape[1] % 128 == 0, fn, "hidden %d of an fp8 x is not a multiple of 128",
              q.shape[1])
        check(isinstance(s, torch.Tensor) and s.dtype in (torch.float32, torch.int32)
              and s.dim() == 2 and s.shape[0] == q.shape[0] and s.shape[1] >= 1, fn,
              "x[1] (the scales) must be float32 or int32 [num_tokens=%d, num_scales] (DeepEP "
              "moves 4-byte scales), not %s %s", q.shape[0],
              getattr(s, "dtype", type(s).__name__), list(getattr(s, "shape", [])))
        check(s.device == q.device, fn, "the scales are on %s but x on %s", s.device, q.device)
        return q.contiguous(), s.contiguous()
    if not (isinstance(x, torch.Tensor) and x.dim() == 2
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)):
        raise ValueError("epx.deep_ep: %s: x must be a [num_tokens, hidden] bfloat16 (DeepEP's), "
                         "float16 or float32 tensor, or an fp8 (x, scales) tuple; not %s %s" % (
                             fn, getattr(x, "dtype", type(x).__name__),
                             list(getattr(x, "shape", []))))
    return (x if x.is_contiguous() else x.contiguous()), None


def native_scales(q, s):
    """Whether epx's fp8 exchange carries these scales itself (float32, one a
    128 columns: its E4M3_F32_128 rows); other scales move beside the rows."""
    return s.dtype == torch.float32 and s.shape[1] == q.shape[1] // 128


def _fp8_pair(x, scales):
    """What epx's fp8 dispatch is given: the scales, or (for scales it does
    not carry) placeholder ones, the real ones then moving beside the rows."""
    if native_scales(x, scales):
        return x, scales
    return x, torch.ones((x.shape[0], x.shape[1] // 128), dtype=torch.float32, device=x.device)


def check_routing(topk_idx, topk_weights, T, num_experts, fn):
    check(isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2 and topk_idx.shape[0] == T,
          fn, "topk_idx must be [num_tokens=%d, num_topk], not %s", T,
          list(topk_idx.shape) if isinstance(topk_idx, torch.Tensor) else type(topk_idx).__name__)
    check(not topk_idx.is_floating_point() and topk_idx.dtype != torch.bool, fn,
          "topk_idx has dtype %s; pass deep_ep.topk_idx_t (torch.int64)", topk_idx.dtype)
    if topk_weights is not None:
        check(isinstance(topk_weights, torch.Tensor) and topk_weights.dtype == torch.float32
              and tuple(topk_weights.shape) == tuple(topk_idx.shape), fn,
              "topk_weights must be float32 %s like topk_idx, not %s %s", list(topk_idx.shape),
              getattr(topk_weights, "dtype", None), list(getattr(topk_weights, "shape", [])))
    check(num_experts is not None and int(num_experts) > 0, fn, "num_experts must be given")


_ARANGE = {}


def _ranks(num_ranks, device):
    """torch.arange(num_ranks) on device (int64), made once (ranks' or
    experts' ids)."""
    key = (num_ranks, device)
    r = _ARANGE.get(key)
    if r is None:
        r = _ARANGE[key] = torch.arange(num_ranks, device=device)
    return r


def dispatch_layout(topk_idx, num_experts, num_ranks, fn):
    """DeepEP's get_dispatch_layout, on the caller's device: (tokens per rank
    [W] int32, tokens per expert [E] int32, is_token_in_rank [T, W] bool).
    No host wait, as DeepEP's layout kernel: an id outside [-1, E) counts
    nowhere here (as there), and the dispatch refuses it (epx's layout
    checks every id)."""
    check(num_experts % num_ranks == 0, fn, "num_experts %d is not a multiple of the %d ranks",
          num_experts, num_ranks)
    in_rank = in_rank_of(topk_idx, num_experts, num_ranks)
    per_rank = in_rank.sum(dim=0, dtype=torch.int32)
    if topk_idx.device.type == "cpu":
        ids = topk_idx.numpy().reshape(-1)  # (a host read only where the ids are on the host)
        if ids.size and (ids.min() < -1 or ids.max() >= num_experts):
            raise ValueError("epx.deep_ep: %s: topk_idx holds an expert id outside [-1, %d)"
                             % (fn, num_experts))
        # the -1s counted in bin 0, dropped
        per_expert = np.bincount(ids.astype(np.int64) + 1, minlength=num_experts + 1)[1:]
        return per_rank, torch.from_numpy(per_expert.astype(np.int32)), in_rank
    # a [T * K, E] comparison: two kernels, no atomics, no host wait (bincount
    # would read its extent), -1 (and a bad id) nowhere
    per_expert = (topk_idx.reshape(-1, 1) == _ranks(num_experts, topk_idx.device)).sum(
        dim=0, dtype=torch.int32)
    return per_rank, per_expert, in_rank


class Layout:
    """One fresh dispatch: the epx Dispatched (exact rows) and what DeepEP's
    handles and the small all-to-alls need (the sources of the rows read
    from epx when first asked)."""

    __slots__ = ("exchange", "buffer", "d", "T", "K", "E", "rows", "recv_idx", "recv_w",
                 "_src", "in_rank", "send_counts", "recv_counts", "_expand", "routing_idx",
                 "per_rank", "_counts")

    @property
    def counts_host(self):
        """Rows per local expert, a list (no wait after an exact-size
        dispatch: its row count's wait brought them)."""
        if self._counts is None:
            self._counts = self.d.counts_host()
        return self._counts

    def _sources(self):
        if self._src is None:
            rank, token = self.d.recv_source()
            self._src = (rank[:self.rows], token[:self.rows])
        return self._src

    @property
    def src_rank(self):
        return self._sources()[0]

    @property
    def src_token(self):
        return self._sources()[1]


class Exchange:
    """The epx side of one DeepEP buffer (see the module's docstring)."""

    def __init__(self, group, rank, size, num_sms=0):
        self.group, self.rank, self.size = group, rank, size
        self.num_sms = num_sms
        if isinstance(group, epx.Comm):
            self.comm = group                 # the caller's: not closed here
        else:
            self.comm = epx.Comm.create_self() if size == 1 else et.comm_from_process_group(group)
        self.buffers = {}   # (H, dtype, device, E, K) -> epx.Buffer
        self.min_tokens = 0  # the least a buffer is sized for (epx.nemo.configure)
        self.ll_buffers = {}

    # -- buffers ------------------------------------------------------------

    def buffer(self, H, dtype, device, E, K, max_tokens, fn):
        """The rank-major buffer for these shapes holding max_tokens a rank
        (collective when made: every rank reaches it with the same values,
        which callers agree first)."""
        key = (H, dtype, device, E, K)
        b = self.buffers.get(key)
        if b is not None and b.dd_max_tokens >= max_tokens:
            return b
        fields = dict(layout=epx.Layout.RANK_MAJOR, exchange=epx.Exchange.DEDUP,
                      sm_budget=int(self.num_sms))
        if dtype == torch.bfloat16 and H % 128 == 0:
            fields["fp8_format"] = _FP8_FORMAT
        most = max(int(max_tokens), self.min_tokens, 1)
        b = et.make_buffer(self.comm, hidden=H, num_experts=E, max_top_k=K,
                           max_tokens_per_rank=most, dtype=dtype, device=device, **fields)
        b.dd_max_tokens = most
        b.dd_dtype = dtype
        self.buffers[key] = b  # an outgrown buffer lives on in its handles
        return b

    def agree_tokens(self, T):
        if self.size == 1:
            return T
        return int(self.comm.allgather(np.array([T], dtype=np.int64)).max())

    # -- the exchanges ----------------------------------------------------

    def fresh(self, x, scales, topk_idx, topk_w, E, max_tokens, fn):
        """A layout and its payload: a :class:`Layout` and recv_x (and
        recv_scales for fp8 rows). epx.torch checks and converts topk_idx
        (on CUDA without a host wait: epx's layout refuses a bad id)."""
        T, H = x.shape
        K = topk_idx.shape[1]
        dtype = torch.bfloat16 if scales is not None else x.dtype
        b = self.buffer(H, dtype, x.device, E, K, max_tokens, fn)
        check(T <= b.dd_max_tokens, fn, "%d tokens but the buffer holds %d a rank (its "
              "num_max_tokens_per_rank)", T, b.dd_max_tokens)
        if scales is not None and epx.FP8Format(b.config.fp8_format) == epx.FP8Format.NONE:
            unsupported(fn, "fp8 x on a buffer of hidden %d (epx's fp8 needs bfloat16 rows of a "
                        "multiple of 128)" % H)
        d = et.dispatch(b, _fp8_pair(x, scales) if scales is not None else x,
                        topk_idx, topk_w,
                        weighting=epx.Weighting.NONE, recorder=False,
                        exact_size=scales is None)
        _count("layouts")
        L = Layout()
        L.exchange, L.buffer, L.T, L.K, L.E = self, b, T, K, E
        if scales is not None:
            rows = d.recv_rows_host()
            d = d._replace(recv_x=d.recv_x[:rows], recv_scales=d.recv_scales[:rows],
                           recv_w=d.recv_w[:rows], recv_expert=d.recv_expert[:rows])
        L.d = d
        L.rows = d.recv_x.shape[0]
        first = self.rank * (E // self.size)
        recv_idx = d.recv_expert.long()
        L.recv_idx = torch.where(recv_idx >= 0, recv_idx - first, recv_idx) if first else recv_idx
        L.recv_w = d.recv_w if topk_w is not None else None
        L._src = L.in_rank = L.send_counts = L.recv_counts = L._expand = L.per_rank = None
        L._counts = None
        L.routing_idx = topk_idx
        recv_s = d.recv_scales
        if scales is not None and not native_scales(x, scales):
            recv_s = self.to_receivers(L, scales)
        return L, d.recv_x, recv_s

    def cached(self, L, x, scales, fn):
        """x along an earlier layout (no layout, no count exchange)."""
        b = L.buffer
        want = torch.bfloat16 if scales is not None else x.dtype
        if x.shape[0] != L.T or x.shape[1] != b.hidden or want != b.dd_dtype:
            raise ValueError("epx.deep_ep: %s: x is %s [%d, %d] but the handle's dispatch moved "
                             "%s [%d, %d]" % (fn, x.dtype, x.shape[0], x.shape[1],
                                              et.torch_dtype(b.dtype), L.T, b.hidden))
        if scales is not None and epx.FP8Format(b.config.fp8_format) == epx.FP8Format.NONE:
            unsupported(fn, "fp8 x on a buffer of hidden %d (epx's fp8 needs bfloat16 rows of a "
                        "multiple of 128)" % x.shape[1])
        _count("cached_dispatches")
        if scales is None and x.dtype == b.dd_dtype and x.device.type != "meta":
            # epx.torch.dispatch(b, x, handle=L.d)'s op, called as it calls it (the op checks
            # x against the handle's buffer: dtype, shape, device)
            recv_x = torch.ops.epx.dispatch_cached(x, L.d.handle_id, L.d.recv_x.shape[0],
                                                   L.d.top_k)
            return (recv_x if recv_x.shape[0] == L.rows else recv_x[:L.rows]), None
        d = et.dispatch(b, _fp8_pair(x, scales) if scales is not None else x, handle=L.d)
        recv_x = d.recv_x if d.recv_x.shape[0] == L.rows else d.recv_x[:L.rows]
        recv_s = d.recv_scales[:L.rows] if scales is not None else None
        if scales is not None and not native_scales(x, scales):
            recv_s = self.to_receivers(L, scales)
        return recv_x, recv_s

    def combine(self, L, x, fn):
        """x [N, H] -> [T, H]: each token's rows summed over the ranks."""
        b = L.buffer
        if not (isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] >= L.rows
                and x.shape[1] == b.hidden and x.dtype == b.dd_dtype):
            raise ValueError("epx.deep_ep: %s: x must be %s [num_recv_tokens=%d, hidden=%d], "
                             "not %s %s" % (fn, et.torch_dtype(b.dtype), L.rows, b.hidden,
                                            getattr(x, "dtype", type(x).__name__),
                                            list(getattr(x, "shape", []))))
        _count("combines")
        if x.shape[0] != L.rows:
            x = x[:L.rows]
        x = x if x.is_contiguous() else x.contiguous()
        d = L.d
        if d.weighting == epx.Weighting.NONE and x.device.type != "meta":
            # et.combine(d, x)'s op, called as it calls it (no weights applied: w None; the op
            # checks x against the handle's buffer)
            return torch.ops.epx.combine(x, None, d.handle_id, d.num_tokens, d.weighting)
        return et.combine(d, x)

    # -- per-token tensors beside the rows -----------------------------------

    def _counts(self, L):
        if L.send_counts is None:
            if L.in_rank is None:
                L.in_rank = in_rank_of(L.routing_idx, L.E, self.size)
            L.send_counts = L.in_rank.sum(dim=0).tolist()
            L.recv_counts = torch.bincount(L.src_rank.long(), minlength=self.size).tolist()
        return L.send_counts, L.recv_counts

    def to_sources(self, L, v):
        """v [N, C] float32 (a value per received row) -> [T, C]: each
        token's rows summed over the ranks, in ascending rank order."""
        send, recv = self._counts(L)
        C = v.shape[1]
        v = v[:L.rows].contiguous()
        back = v if self.size == 1 else self._all_to_all(v, recv, send)
        # back: from rank r, the rows of this rank's tokens in is_token_in_rank[:, r], by token
        ranks, tokens = L.in_rank.t().nonzero(as_tuple=True)
        dense = v.new_zeros((self.size, L.T, C))
        dense[ranks, tokens] = back
        return dense.sum(dim=0)

    def to_receivers(self, L, v):
        """v [T, C] (a value per source token) -> [N, C], the rows' values in
        the received order (each token's value to every rank it went to)."""
        send, recv = self._counts(L)
        ranks, tokens = L.in_rank.t().nonzero(as_tuple=True)
        out_rows = v[tokens].contiguous()
        if self.size == 1:
            return out_rows
        return self._all_to_all(out_rows, send, recv)

    def _all_to_all(self, v, send, recv):
        """v [sum(send), ...] -> [sum(recv), ...]: send[r] rows to rank r,
        recv[s] rows from rank s (the process group's all_to_all_single, or
        the epx.Comm's alltoallv through the host: a comm given as the
        group, or CUDA values over the shm comm of processes that share a
        GPU, where an NCCL group cannot run and a gloo one may not take
        CUDA tensors)."""
        shared_gpu = v.is_cuda and getattr(self.comm, "transport", None) in ("ipc", "shm")
        if isinstance(self.group, epx.Comm) or shared_gpu:
            raw = v.detach().cpu().reshape(v.shape[0], -1).view(torch.uint8).numpy()
            got = self.comm.alltoallv(raw, send)
            if got.shape[0] == 0:               # nothing comes (numpy's empty rows have stride 0)
                return v.new_empty((0,) + tuple(v.shape[1:]))
            got = torch.from_numpy(np.ascontiguousarray(got)).view(v.dtype)
            return got.reshape((-1,) + tuple(v.shape[1:])).to(v.device)
        got = v.new_empty((sum(recv),) + tuple(v.shape[1:]))
        dist.all_to_all_single(got, v, output_split_sizes=recv, input_split_sizes=send,
                               group=self.group)
        return got

    def close(self, strict=False):
        """Closes the epx buffers. One a pending backward still holds
        (BusyError) is left to be freed with the graph that holds it, or,
        with strict, kept usable and the error raised (close again later)."""
        failed = None
        for cache in (self.buffers, self.ll_buffers):
            for key, b in list(cache.items()):
                try:
                    b.close()
                except epx.EpxError as e:
                    if strict:
                        failed = failed or e
                        continue
                cache.pop(key, None)
        if failed is not None:
            raise failed


def in_rank_of(topk_idx, num_experts, num_ranks):
    """is_token_in_rank [T, W] bool of a routing."""
    idx = topk_idx.long()
    return (idx.unsqueeze(-1) // (num_experts // num_ranks)
            == _ranks(num_ranks, idx.device)).any(dim=1)
