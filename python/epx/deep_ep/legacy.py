"""DeepEP's V1 ``Buffer`` (``deep_ep/buffers/legacy.py``) on epx.torch.

Normal mode: get_dispatch_layout, dispatch (with a layout, or a cached
``handle=``), combine, and their ``internode_*`` forms (one code path: epx
picks its intranode or hierarchical exchange from the comm's topology).
Low-latency mode: low_latency_dispatch / low_latency_combine on an epx
low-latency buffer. Every call runs on PyTorch's current stream;
``previous_event`` is waited for first, ``async_finish`` returns an event
recorded after the call. Outputs carry no autograd (as DeepEP's): the
frameworks wrap them in their own autograd functions."""
import collections.abc
from typing import Callable, List, Optional, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist

from epx.torch.tensors import _host_copy, _host_values
from . import _core
from ._core import check, unsupported
from .utils import EventHandle, EventOverlap

_NUM_MAX_NVL_PEERS = 8


class Config:
    """DeepEP's performance config (``deep_ep.Config``): SMs and chunk
    sizes. epx keeps it for the calls' signatures; num_sms becomes the SM
    budget of epx's fused CUDA kernels, the chunk sizes have no epx
    counterpart (epx moves whole rows, not chunks)."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256,
                 num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        # DeepEP's checks (csrc/legacy/config.hpp), and its RDMA receive size
        # rounded up to a multiple of the send chunk
        check(num_sms >= 0, "Config", "num_sms %d < 0", num_sms)
        check(0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens, "Config",
              "the NVLink chunks must be 0 < send (%d) < recv (%d)",
              num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens)
        check(num_max_rdma_chunked_send_tokens > 0 and num_max_rdma_chunked_recv_tokens > 0,
              "Config", "the RDMA chunks must be > 0")
        num_max_rdma_chunked_recv_tokens = -(-num_max_rdma_chunked_recv_tokens
                                             // num_max_rdma_chunked_send_tokens) \
            * num_max_rdma_chunked_send_tokens
        check(num_max_rdma_chunked_send_tokens <= num_max_rdma_chunked_recv_tokens // 2, "Config",
              "the RDMA send chunk %d must be at most half the receive chunk %d",
              num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens)
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's NVLink buffer size for these chunks (what its Buffer
        would take; epx sizes its own memory from the dispatches)."""
        rdma = max(num_ranks // _NUM_MAX_NVL_PEERS, 1)
        nvl = min(num_ranks, _NUM_MAX_NVL_PEERS)
        channels = self.num_sms // 2
        per_token = hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4
        n = channels * nvl * (2 * rdma + 3) * 4
        n += channels * nvl * self.num_max_nvl_chunked_recv_tokens * per_token
        return (n + 127) // 128 * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's RDMA buffer size (0 on one node of up to 8 ranks)."""
        if num_ranks <= _NUM_MAX_NVL_PEERS:
            return 0
        rdma = num_ranks // _NUM_MAX_NVL_PEERS
        channels = self.num_sms // 2
        per_token = hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4 + 16
        n = channels * rdma * (_NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
        n += channels * rdma * self.num_max_rdma_chunked_recv_tokens * per_token * 2
        return (n + 127) // 128 * 128

    def __repr__(self):
        return "Config(num_sms=%d, nvl_send=%d, nvl_recv=%d, rdma_send=%d, rdma_recv=%d)" % (
            self.num_sms, self.num_max_nvl_chunked_send_tokens,
            self.num_max_nvl_chunked_recv_tokens, self.num_max_rdma_chunked_send_tokens,
            self.num_max_rdma_chunked_recv_tokens)


class Handle(collections.abc.Sequence):
    """DeepEP's V1 dispatch handle: the sequence (rank_prefix_matrix [W, W]
    int32, channel_prefix_matrix [W, 1] int32, recv_channel_prefix_matrix
    [W, 1] int32, recv_src_idx [N] int32, is_token_in_rank [T, W] bool,
    send_head [T, W] int32), epx's layout behind it (``handle[0]``, unpacking
    and len() as DeepEP's tuple; each item made when first read). epx moves a
    rank's rows as one channel: the channel matrices have one column, and
    send_head holds each token's row among those this rank sends to a rank
    (-1 where it sends none)."""

    __slots__ = ("layout", "_items")

    def __init__(self, layout):
        self.layout = layout
        self._items = [None] * 6

    def __len__(self):
        return 6

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(6)))
        i = range(6)[i]
        if self._items[i] is None:
            self._items[i] = self._make(i)
        return self._items[i]

    def _make(self, i):
        L = self.layout
        rank = L.exchange.rank
        dev = L.d.recv_x.device
        if i == 0:
            return torch.from_numpy(L.per_rank.cumsum(axis=0).astype(np.int32)).to(dev)
        if i == 1:
            return torch.from_numpy(L.per_rank[rank].astype(np.int32)).reshape(-1, 1).to(dev)
        if i == 2:
            return torch.from_numpy(L.per_rank[:, rank].astype(np.int32)).reshape(-1, 1).to(dev)
        if i == 3:
            return L.src_token.to(torch.int32)
        if i == 4:
            return L.in_rank
        t = L.in_rank.to(torch.int32)
        return torch.where(L.in_rank, t.cumsum(dim=0) - 1, -1).to(torch.int32)


def _wait(previous_event):
    if previous_event is not None and getattr(previous_event, "event", None) is not None:
        previous_event.event.current_stream_wait()


def _event(async_finish, tensors=None):
    return EventOverlap(EventHandle(), tensors) if async_finish else EventOverlap(None)


# DeepEP's recommended configs per rank count: the chunk sizes after num_sms
# (nvl send, nvl recv, rdma send, rdma recv tokens).
_DISPATCH_CONFIGS = {
    2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
    24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
    96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128),
    160: (28, 720, 12, 128),
}
_COMBINE_CONFIGS = {
    2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
    96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128),
}


def _recommended_config(table, num_ranks):
    # epx has no rank-count limit: any other count gets the 8-rank values
    return Config(Buffer.num_sms, *table.get(num_ranks, table[8]))


class Buffer:
    """DeepEP's V1 communication buffer over epx (see the module's docstring).

    The byte sizes are kept for DeepEP's attributes; epx sizes its memory
    for the most tokens any rank has given a dispatch so far (agreed with
    the ranks at each fresh dispatch: a larger batch makes a larger buffer
    on every rank together, never a rank-local resize)."""

    num_sms: int = 20

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None) -> None:
        self.rank, self.group_size, self.group = _core.group_of(group, comm, "Buffer")
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.num_qps_per_rank = num_qps_per_rank
        self.runtime = _core.Exchange(self.group, self.rank, self.group_size)
        self._mask = torch.zeros(self.group_size, dtype=torch.int32)
        self._ll_next = {}

    # -- lifetime and settings ----------------------------------------------

    def destroy(self):
        """Releases the epx buffers and comm (collective)."""
        assert self.explicitly_destroy, '`explicitly_destroy` flag must be set'
        self.runtime.close()
        self.runtime = None

    def _rt(self, fn):
        if self.runtime is None:
            raise RuntimeError("epx.deep_ep: Buffer.%s after destroy()" % fn)
        self.runtime.num_sms = Buffer.num_sms
        return self.runtime

    @staticmethod
    def is_sm90_compiled():
        """True: epx's fp8 dispatch is there (on CPU as well)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """SMs of the normal kernels: the SM budget of epx's fused CUDA
        kernels in the buffers made from now on."""
        assert new_num_sms % 2 == 0, 'The SM count must be even'
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """DeepEP's low-latency RDMA buffer size for these shapes (its
        LowLatencyLayout's bytes, rounded as csrc/legacy/config.hpp rounds
        them); epx sizes its own low-latency buffer from the calls."""
        num_scales = hidden // 128
        msg_dispatch = 16 + max(hidden * 2, hidden + num_scales * 4)
        msg_combine = num_scales * 4 + hidden * 2
        send = max(num_max_dispatch_tokens_per_rank * msg_dispatch,
                   num_experts * num_max_dispatch_tokens_per_rank * msg_combine)
        recv = num_experts * num_max_dispatch_tokens_per_rank * max(msg_dispatch, msg_combine)
        signaling = (num_experts * 4 + 127) // 128 * 128
        total = 2 * (send + recv + signaling)
        return (total + 128) // 128 * 128

    def get_comm_stream(self) -> torch.Stream:
        """The stream epx's calls run on: PyTorch's current CUDA stream."""
        return _core.comm_stream("Buffer.get_comm_stream")

    def get_local_buffer_tensor(self, dtype, size=None, offset=0, use_rdma_buffer=False):
        unsupported("Buffer.get_local_buffer_tensor", "epx does not expose its exchange memory "
                    "as a raw tensor (its buffers are sized per layer and may grow)")

    @staticmethod
    def _unpack_bias(bias):
        bias_0, bias_1 = None, None
        if isinstance(bias, torch.Tensor):
            bias_0 = bias
        elif isinstance(bias, tuple):
            assert len(bias) == 2
            bias_0, bias_1 = bias
        return bias_0, bias_1

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended dispatch config (the SM count is used)."""
        return _recommended_config(_DISPATCH_CONFIGS, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's recommended combine config (the SM count is used)."""
        return _recommended_config(_COMBINE_CONFIGS, num_ranks)

    # -- normal mode -----------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False) \
            -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor,
                     EventOverlap]:
        """(num_tokens_per_rank [W] int32, None (one level of ranks),
        num_tokens_per_expert [E] int32, is_token_in_rank [T, W] bool, event);
        local (no communication)."""
        fn = "Buffer.get_dispatch_layout"
        check(isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2, fn,
              "topk_idx must be [num_tokens, num_topk]")
        check(not topk_idx.is_floating_point(), fn, "topk_idx has dtype %s; pass "
              "deep_ep.topk_idx_t (torch.int64)", topk_idx.dtype)
        _wait(previous_event)
        per_rank, per_expert, in_rank = _core.dispatch_layout(topk_idx, int(num_experts),
                                                              self.group_size, fn)
        return per_rank, None, per_expert, in_rank, _event(async_finish)

    @_core.opaque
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> \
            Tuple[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor], Optional[torch.Tensor],
                  Optional[torch.Tensor], List[int], Tuple, EventOverlap]:
        """DeepEP's dispatch: (recv_x (a tuple for fp8 x), recv_topk_idx
        [N, K] int64 local ids (-1 elsewhere), recv_topk_weights [N, K]
        float32 (0 elsewhere), num_recv_tokens_per_expert_list (aligned to
        expert_alignment; [] with num_worst_tokens), handle, event). Rows by
        source rank, then token. With ``handle=``: the payload only, along
        that layout; (recv_x, None, None, None, None, event)."""
        fn = "Buffer.dispatch"
        rt = self._rt("dispatch")
        xs, scales = _core.split_x(x, fn)
        _wait(previous_event)
        if handle is not None:
            check(topk_idx is None and topk_weights is None, fn, "a dispatch with handle= "
                  "takes no topk_idx / topk_weights (the handle's layout is used)")
            L = _layout_of(handle, fn)
            recv_x, recv_s = rt.cached(L, xs, scales, fn)
            recv_x = _pad_rows(recv_x, num_worst_tokens)
            recv_s = _pad_rows(recv_s, num_worst_tokens) if recv_s is not None else None
            out = (recv_x, recv_s) if scales is not None else recv_x
            return out, None, None, None, None, _event(async_finish)
        return self._dispatch_fresh(rt, xs, scales, num_tokens_per_rank, is_token_in_rank,
                                    num_tokens_per_expert, topk_idx, topk_weights,
                                    expert_alignment, num_worst_tokens, async_finish, fn)

    def _dispatch_fresh(self, rt, x, scales, num_tokens_per_rank, is_token_in_rank,
                        num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                        num_worst_tokens, async_finish, fn):
        W = self.group_size
        T = x.shape[0]
        check(num_tokens_per_rank is not None and is_token_in_rank is not None
              and num_tokens_per_expert is not None, fn, "num_tokens_per_rank, is_token_in_rank "
              "and num_tokens_per_expert must be given (from get_dispatch_layout), or handle=")
        check(tuple(is_token_in_rank.shape) == (T, W) and is_token_in_rank.dtype == torch.bool,
              fn, "is_token_in_rank must be bool [num_tokens=%d, num_ranks=%d], not %s %s", T, W,
              is_token_in_rank.dtype, list(is_token_in_rank.shape))
        check(tuple(num_tokens_per_rank.shape) == (W,), fn, "num_tokens_per_rank must be [%d]", W)
        check(num_tokens_per_expert.dim() == 1 and num_tokens_per_expert.shape[0] % W == 0, fn,
              "num_tokens_per_expert must be [num_experts] with num_experts a multiple of %d", W)
        check(expert_alignment >= 1, fn, "expert_alignment must be >= 1")
        E = num_tokens_per_expert.shape[0]
        E_local = E // W
        if topk_idx is not None:
            _core.check_routing(topk_idx, topk_weights, T, E, fn)
            idx, w = topk_idx, topk_weights
        else:
            # no top-k: one route per (token, rank) it goes to, to that rank's first expert
            check(topk_weights is None, fn, "topk_weights without topk_idx")
            first = torch.arange(W, device=x.device, dtype=torch.int64) * E_local
            idx = torch.where(is_token_in_rank, first, -1)
            w = None
        # The counts every rank gave: the rank prefix matrix, the received
        # tokens per expert (DeepEP's notify step), and the buffer's size.
        # DeepEP waits for the device once, for the received counts; here
        # that wait is epx's for the row count: on one rank the caller's
        # counts come to the host beside it (a copy started before the
        # dispatch), over several the host exchange needs them first.
        given = torch.cat((num_tokens_per_rank.reshape(-1), num_tokens_per_expert.reshape(-1)))
        if W == 1:
            every, most = None, T
            given = _host_copy(given)
        else:
            pr_pe = given.tolist()
            every = rt.comm.allgather(np.array([T] + pr_pe, dtype=np.int64))
            most = int(every[:, 0].max())
        L, recv_x, recv_s = rt.fresh(x, scales, idx, w, E, most, fn)
        L.in_rank, L.routing_idx = is_token_in_rank, idx
        if every is None:
            pr_pe = _host_values(given).astype(np.int64)
            L.per_rank = pr_pe[None, :1]
            coming = int(pr_pe[0])
            per_expert = pr_pe[1:].tolist()
        else:
            L.per_rank = every[:, 1:1 + W]
            coming = int(L.per_rank[:, self.rank].sum())
            per_expert = every[:, 1 + W + self.rank * E_local:1 + W + (self.rank + 1) * E_local]
            per_expert = per_expert.sum(axis=0).tolist()
        if coming != L.rows:
            raise ValueError("epx.deep_ep: %s: the ranks' num_tokens_per_rank say %d tokens come "
                             "to rank %d but their routing sends %d; pass the layout of "
                             "get_dispatch_layout(topk_idx)" % (fn, coming, self.rank, L.rows))
        a = expert_alignment
        counts = per_expert if a == 1 else [(c + a - 1) // a * a for c in per_expert]
        h = Handle(L)
        recv_idx = L.recv_idx if topk_idx is not None else None
        recv_w = L.recv_w if topk_weights is not None else None
        if num_worst_tokens:
            check(num_worst_tokens >= L.rows, fn, "num_worst_tokens %d < the %d tokens received",
                  num_worst_tokens, L.rows)
            recv_x = _pad_rows(recv_x, num_worst_tokens)
            recv_s = _pad_rows(recv_s, num_worst_tokens) if recv_s is not None else None
            if recv_idx is not None:
                recv_idx = _pad_rows(recv_idx, num_worst_tokens, -1)
            if recv_w is not None:
                recv_w = _pad_rows(recv_w, num_worst_tokens)
            counts = []
        out = (recv_x, recv_s) if scales is not None else recv_x
        return out, recv_idx, recv_w, counts, h, _event(async_finish)

    @_core.opaque
    def combine(self, x: torch.Tensor, handle: Tuple, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """DeepEP's combine: x [N, H] -> (combined_x [T, H], each token's rows
        summed over its ranks, no weights applied; combined_topk_weights
        [T, K] float32, topk_weights [N, K] summed the same way, or None;
        event). bias (one tensor or two) [T, H] is added to the sum."""
        fn = "Buffer.combine"
        rt = self._rt("combine")
        L = _layout_of(handle, fn)
        _wait(previous_event)
        out = rt.combine(L, x, fn)
        out = _add_bias(out, bias, L.T, fn)
        w = None
        if topk_weights is not None:
            check(topk_weights.dim() == 2 and topk_weights.shape[0] >= L.rows, fn,
                  "topk_weights must be [num_recv_tokens=%d, num_topk], not %s", L.rows,
                  list(topk_weights.shape))
            w = rt.to_sources(L, topk_weights[:L.rows].float())
        return out, w, _event(async_finish)

    def internode_dispatch(self, x, handle=None, num_tokens_per_rank=None,
                           num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                           num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                           expert_alignment=1, config=None, previous_event=None,
                           async_finish=False, allocate_on_comm_stream=False):
        """dispatch across nodes: the same call (epx's hierarchical exchange
        is chosen from the comm's topology, not by the caller)."""
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                             is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                             expert_alignment, 0, config, previous_event, async_finish,
                             allocate_on_comm_stream)

    def internode_combine(self, x, handle, topk_weights=None, bias=None, config=None,
                          previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        """combine across nodes: the same call as :meth:`combine`."""
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream)

    # -- low-latency mode ------------------------------------------------------

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Nothing to clean: epx's low-latency buffers need no zeroed state
        between calls (normal and low-latency calls use separate buffers)."""
        self._rt("clean_low_latency_buffer")

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False) -> \
            Tuple[Tuple[torch.Tensor, torch.Tensor], torch.Tensor, Tuple, EventOverlap, Callable]:
        """DeepEP's low_latency_dispatch: see :mod:`epx.deep_ep.low_latency`."""
        from . import low_latency
        return low_latency.dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank,
                                    num_experts, cumulative_local_expert_recv_stats,
                                    dispatch_wait_recv_cost_stats, use_fp8, round_scale,
                                    use_ue8m0, async_finish, return_recv_hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle: tuple, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                            overlap: bool = False, packed_recv_count: Optional[torch.Tensor] = None,
                            comp_signal: Optional[torch.Tensor] = None, block_m: int = 64,
                            threshold: int = 0, num_sms: int = 0,
                            src_signals: Optional[torch.Tensor] = None,
                            src_signal_expect_value: int = 0) -> \
            Tuple[torch.Tensor, EventOverlap, Callable]:
        """DeepEP's low_latency_combine: see :mod:`epx.deep_ep.low_latency`.
        The arguments from ``overlap`` on are SGLang's DeepEP fork's (its
        single-batch overlap: the combine sends each expert's rows as a
        GEMM signals them); accepted with overlap=False, refused with
        overlap=True (epx's combine would not wait for the signals)."""
        from . import low_latency
        if overlap:
            unsupported("Buffer.low_latency_combine", "overlap=True (SGLang's DeepEP fork: a "
                        "combine that waits for the expert GEMM's signals, comp_signal / "
                        "src_signals); epx has no signal wait, run without single-batch overlap")
        return low_latency.combine(self, x, topk_idx, topk_weights, handle, use_logfmt,
                                   zero_copy, async_finish, return_recv_hook, out,
                                   combine_wait_recv_cost_stats)

    def get_next_low_latency_combine_buffer(self, handle: object):
        """The tensor the next low_latency_combine reads with zero_copy=True:
        bfloat16 [E_local, W * num_max_dispatch_tokens_per_rank, hidden]."""
        from . import low_latency
        return low_latency.next_combine_buffer(self, handle)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False):
        """Masks (or unmasks) a rank (DeepEP's shrink mode; epx_ll_mask_rank):
        this rank's later low-latency calls complete among the unmasked ranks
        and drop the routes to a masked rank's experts. Every survivor masks
        the same ranks. The mask lives on the comm of the Buffer's
        low-latency epx buffers, so it needs one (made by the first
        low_latency_dispatch) and a comm whose transport keeps a mask (CPU
        buffers over a local or shm comm); elsewhere masking is NotImplementedError
        naming why (shrink the comm instead). Unmasking a rank that is not
        masked does nothing."""
        fn = "Buffer.low_latency_update_mask_buffer"
        self._shrink("low_latency_update_mask_buffer")
        check(0 <= rank_to_mask < self.group_size, fn,
              "rank_to_mask %d outside [0, %d)", rank_to_mask, self.group_size)
        b = self._mask_buffer()
        if b is None:
            if mask:
                unsupported(fn, "masking a rank before the Buffer's first low_latency_dispatch: epx "
                            "keeps the mask on the comm of its low-latency buffer, made by that call "
                            "(or shrink the comm: a Buffer over the surviving ranks' group)")
            return
        b.ll_mask_rank(int(rank_to_mask), bool(mask))
        self._mask[rank_to_mask] = int(bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor):
        """mask_status [W] int32 <- 1 for each masked rank, else 0 (epx_ll_query_mask)."""
        self._shrink("low_latency_query_mask_buffer")
        check(isinstance(mask_status, torch.Tensor) and mask_status.dtype == torch.int32
              and tuple(mask_status.shape) == (self.group_size,),
              "Buffer.low_latency_query_mask_buffer", "mask_status must be int32 [%d]",
              self.group_size)
        b = self._mask_buffer()
        mask = b.ll_query_mask() if b is not None else [0] * self.group_size
        mask_status.copy_(torch.tensor(mask, dtype=torch.int32))

    def low_latency_clean_mask_buffer(self):
        """Unmasks every rank (epx_ll_clean_mask)."""
        self._shrink("low_latency_clean_mask_buffer")
        b = self._mask_buffer()
        if b is not None:
            b.ll_clean_mask()
        self._mask.zero_()

    def _mask_buffer(self):
        """A low-latency epx buffer of the Buffer (the mask is their comm's), or None."""
        buffers = self._rt("low_latency_update_mask_buffer").ll_buffers
        return next(iter(buffers.values()), None)

    def _shrink(self, fn):
        self._rt(fn)
        if not self.enable_shrink:
            raise AssertionError("Buffer.%s needs a Buffer made with enable_shrink=True" % fn)


def _layout_of(handle, fn):
    if not isinstance(handle, Handle):
        raise TypeError("epx.deep_ep: %s: handle is a %s; pass the handle an epx.deep_ep "
                        "Buffer.dispatch returned" % (fn, type(handle).__name__))
    return handle.layout


def _pad_rows(t, rows, value=0):
    if not rows or t.shape[0] >= rows:
        return t
    pad = t.new_full((rows - t.shape[0],) + tuple(t.shape[1:]), value)
    return torch.cat([t, pad])


def _add_bias(out, bias, T, fn):
    bias_0, bias_1 = Buffer._unpack_bias(bias)
    if bias_0 is None and bias_1 is None:
        return out
    acc = out.float()
    for b in (bias_0, bias_1):
        if b is not None:
            check(tuple(b.shape) == tuple(out.shape), fn, "bias must be [%d, %d], not %s", T,
                  out.shape[1], list(b.shape))
            acc = acc + b.float()
    return acc.to(out.dtype)
