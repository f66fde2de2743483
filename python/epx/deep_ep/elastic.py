"""DeepEP's V2 ``ElasticBuffer`` and ``EPHandle`` (``deep_ep/buffers/
elastic.py``) on epx.torch: dispatch (source-major, or expanded with
``do_expand``: a row per (token, local expert) grouped by expert and padded
to ``expert_alignment``), cached dispatch on a handle, combine, barrier.

A token travels once per destination rank (epx's rank-major dedup
exchange); the expanded layout is made on the receiving rank from those rows
(DeepEP's copy epilogue), and folded back there before combine. Engram, PP
and AGRS are not offered (NotImplementedError)."""
import math
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

import epx

from . import _core
from ._core import check, unsupported
from .legacy import _add_bias
from .utils import EventHandle, EventOverlap

_ALIGNMENT = 2 << 20  # DeepEP's 2 MiB buffer alignment


def _out_of_scope(name):
    """ElasticBuffer's method `name`, which epx does not offer: it raises
    NotImplementedError naming itself."""
    def method(self, *args, **kwargs):
        unsupported("ElasticBuffer." + name, "Engram, pipeline-parallel send/recv and AGRS "
                    "(all-gather/reduce-scatter) are not offered by epx")
    method.__name__ = name
    return method


class EPHandle:
    """DeepEP's V2 handle (see ``deep_ep.EPHandle``): the attributes its
    callers read, over an epx layout.

    - ``psum_num_recv_tokens_per_scaleup_rank`` [W] int32: inclusive prefix
      sum of the tokens received from each rank (once per rank);
    - ``psum_num_recv_tokens_per_expert`` [E_local] int32: DeepEP's prefix
      sum (source-major: inclusive; expanded: each expert's aligned start
      plus its real count);
    - ``recv_src_metadata`` [N, 2 + K] int32: the source token's global
      index (rank * num_max_tokens_per_rank + token), the row, then for each
      k-slot its row in the expanded layout (-1 where not local or not
      expanded);
    - ``num_recv_tokens`` / ``num_expanded_tokens`` ints (exact: epx's
      layout knows them on the host)."""

    def __init__(self, do_expand, num_experts, expert_alignment, num_max_tokens_per_rank,
                 num_sms, topk_idx, layout):
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.layout = layout
        self.token_metadata_at_forward = None
        self.channel_linked_list = None
        self.dst_buffer_slot_idx = None
        self.cached_recv_src_metadata_before_sort = None
        L = layout
        self.num_recv_tokens = L.rows
        counts, a = L.counts_host, expert_alignment
        # the last expert's start plus its count (DeepEP's psum[-1])
        self.num_expanded_tokens = (sum(_core.aligned(c, a) for c in counts[:-1]) + counts[-1]
                                    if counts and do_expand else sum(counts))
        self.cpu_synced = True

    def _no_cpu_sync(self, num_ranks):
        """DeepEP's handle of a dispatch with do_cpu_sync=False: the worst-case
        row counts (its allocation), no host list of the experts' counts."""
        self.cpu_synced = False
        mt, a = self.num_max_tokens_per_rank, self.expert_alignment
        E_local = self.num_experts // num_ranks
        self.num_recv_tokens = num_ranks * mt
        n = num_ranks * mt * min(self.layout.K, E_local) + (a - 1) * E_local
        self.num_expanded_tokens = -(-n // a) * a
        self.__dict__["num_recv_tokens_per_expert_list"] = []

    # Read when first asked (each a few small tensor ops on the layout)
    _LAZY = ("psum_num_recv_tokens_per_scaleup_rank", "num_unaligned_recv_tokens_per_expert",
             "num_recv_tokens_per_expert_list", "recv_src_metadata",
             "psum_num_recv_tokens_per_expert")

    def __getattr__(self, name):
        if name not in EPHandle._LAZY:
            raise AttributeError(name)
        L = self.layout
        if name == "psum_num_recv_tokens_per_scaleup_rank":
            per_src = torch.bincount(L.src_rank.long(), minlength=L.exchange.size)
            value = per_src.cumsum(0).to(torch.int32)
        elif name == "num_unaligned_recv_tokens_per_expert":
            value = L.d.counts.to(torch.int32)
        elif name == "num_recv_tokens_per_expert_list":
            a = self.expert_alignment
            value = [_core.aligned(c, a) for c in L.counts_host]
        elif name == "psum_num_recv_tokens_per_expert":
            counts, a = L.d.counts, self.expert_alignment
            if self.do_expand and a != 1:
                aligned = _core.aligned(counts, a)
                value = (aligned.cumsum(0) - aligned + counts).to(torch.int32)
            else:                               # (aligned to 1: starts + counts is the cumsum)
                value = counts.cumsum(0).to(torch.int32)
        else:
            meta = torch.full((L.rows, 2 + L.K), -1, dtype=torch.int32, device=L.recv_idx.device)
            meta[:, 0] = L.src_rank * self.num_max_tokens_per_rank + L.src_token
            meta[:, 1] = torch.arange(L.rows, dtype=torch.int32, device=meta.device)
            if self.do_expand:
                meta[:, 2:] = _expansion(L, self.expert_alignment)["pos"].to(torch.int32)
            value = _pad(meta, self.num_recv_tokens, -1)
        self.__dict__[name] = value
        return value


def _expansion(L, alignment):
    """Where each (row, k-slot) with a local expert lands in the expanded
    layout: grouped by local expert, by row (source rank, token) inside a
    group, each group starting at a multiple of alignment. The sizes come
    from the host counts (no wait of its own: no nonzero, no host sum)."""
    key = ("expand", alignment)
    if L._expand is not None and L._expand[0] == key:
        return L._expand[1]
    idx = L.recv_idx                                   # [N, K] local ids, -1 elsewhere
    K = idx.shape[1]
    counts = L.counts_host
    m = sum(counts)                                    # (row, k) pairs with a local expert
    # a stable sort by expert: the -1s first, then each expert's pairs by row, then k
    e, order = torch.sort(idx.reshape(-1), stable=True)
    start = idx.numel() - m
    f, e = order[start:], e[start:]                    # flat (n, k) of each place, in order
    n = f // K
    if alignment == 1:
        # the groups packed: each (row, k) lands at its place in the sorted order
        dest = torch.arange(m, device=idx.device)
        total = m
    else:
        # each place shifted by the padding of the groups before its expert's
        pad = (-L.d.counts) % alignment
        dest = torch.arange(m, device=idx.device) + (pad.cumsum(0) - pad).index_select(0, e)
        total = sum(_core.aligned(c, alignment) for c in counts)
    pos = torch.full(idx.shape, -1, dtype=torch.int64, device=idx.device)
    pos.view(-1).index_put_((f,), dest)
    ex = dict(pos=pos, n=n, f=f, dest=dest, total=total, dense=alignment == 1)
    L._expand = (key, ex)
    return ex


def _fold(ex, x):
    """x [total, H] (a row per expanded place) -> [N, H] float32: each row's
    places summed in k order (DeepEP's reduction within the rank), in a
    fixed order on every device and with no host wait."""
    N, K = ex["pos"].shape
    if x.device.type == "cpu":
        # CPU index_add_ adds in the given order: the places by row, then k
        if "nk_n" not in ex:
            f, perm = torch.sort(ex["f"])
            ex["nk_n"], ex["nk_dest"] = f // K, ex["dest"].index_select(0, perm)
        acc = torch.zeros((N, x.shape[1]), dtype=torch.float32)
        return acc.index_add_(0, ex["nk_n"], x.index_select(0, ex["nk_dest"]).float())
    # CUDA's index_add_ adds with atomics (no fixed order): one gather of
    # [N, K] rows summed over k instead
    if "gather" not in ex:
        pos = ex["pos"]
        ex["gather"] = pos.clamp(min=0).view(-1)
        ex["empty"] = (pos < 0).unsqueeze(-1)
    rows = x.index_select(0, ex["gather"]).view(N, K, x.shape[1])
    return rows.masked_fill_(ex["empty"], 0).sum(dim=1, dtype=torch.float32)


def _expand_rows(L, alignment, rows, zero_padding=True):
    """rows [N, ...] -> [total, ...]: each (row, local k-slot) at its place."""
    ex = _expansion(L, alignment)
    if ex["dense"]:                                    # dest is 0, 1, ... in this order
        return rows.index_select(0, ex["n"])
    if rows.element_size() == 1 and rows.is_floating_point():
        # fp8 rows: moved as their bytes (index_copy_ has no float8 kernel on the CPU)
        return _expand_rows(L, alignment, rows.view(torch.uint8), zero_padding).view(rows.dtype)
    out = rows.new_zeros((ex["total"],) + tuple(rows.shape[1:]))
    return out.index_copy_(0, ex["dest"], rows.index_select(0, ex["n"]))


def _pad(t, rows, value):
    if t is None or t.shape[0] >= rows:
        return t
    return torch.cat([t, t.new_full((rows - t.shape[0],) + tuple(t.shape[1:]), value)])


class ElasticBuffer:
    """DeepEP's V2 buffer over epx (see the module's docstring). Sized for
    num_max_tokens_per_rank tokens a rank (or for the most tokens any rank
    gives at the first dispatch when 0)."""

    def __init__(self, group: dist.ProcessGroup, num_bytes: Optional[int] = None,
                 num_cpu_bytes: int = 0, num_max_tokens_per_rank: int = 0, hidden: int = 0,
                 num_topk: int = 0, use_fp8_dispatch: bool = False, deterministic: bool = False,
                 allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300,
                 num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False):
        if num_cpu_bytes:
            unsupported("ElasticBuffer", "num_cpu_bytes (host memory for Engram storage): "
                        "Engram is not offered")
        self.group = group
        self.rank_idx, self.num_ranks, _ = _core.group_of(group, None, "ElasticBuffer")
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.deterministic = deterministic
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_bytes = num_bytes if num_bytes is not None else ElasticBuffer.get_buffer_size_hint(
            group, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch)
        self.num_allocated_qps = num_allocated_qps or (65 if allow_hybrid_mode else 17)
        self.explicitly_destroy = explicitly_destroy
        self.num_scaleout_ranks, self.num_scaleup_ranks = 1, self.num_ranks
        self.scaleout_rank_idx, self.scaleup_rank_idx = 0, self.rank_idx
        self.num_rdma_ranks, self.num_nvlink_ranks = 1, self.num_ranks
        self.runtime = _core.Exchange(group, self.rank_idx, self.num_ranks)

    def destroy(self) -> None:
        """Releases the epx buffers and comm (collective)."""
        assert self.explicitly_destroy
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None

    def _rt(self, fn):
        if self.runtime is None:
            raise RuntimeError("epx.deep_ep: ElasticBuffer.%s after destroy()" % fn)
        return self.runtime

    @staticmethod
    def get_buffer_size_hint(group: dist.ProcessGroup, num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int = 0, use_fp8_dispatch: bool = False,
                             allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes a buffer for these shapes takes (2 MiB aligned): epx's
        receive rows (a token once per rank, W * num_max_tokens_per_rank
        rows of hidden elements, routing and source metadata) for the send
        and receive sides."""
        W = group.size if isinstance(group, epx.Comm) else group.size()
        elem = 1 if use_fp8_dispatch else 2
        per_row = hidden * elem + (hidden // 128) * 4 * use_fp8_dispatch + num_topk * 12 + 16
        n = 2 * W * max(num_max_tokens_per_rank, 1) * per_row
        return (n + _ALIGNMENT - 1) // _ALIGNMENT * _ALIGNMENT

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False,
                sequential: bool = True) -> None:
        """A barrier of the ranks (epx's comm barrier, bounded by its
        timeout); with_cpu_sync also synchronizes the device."""
        rt = self._rt("barrier")
        if with_cpu_sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        rt.comm.barrier()
        if with_cpu_sync and torch.cuda.is_available():
            torch.cuda.synchronize()

    @staticmethod
    def capture() -> EventHandle:
        return EventHandle()

    def get_comm_stream(self) -> torch.Stream:
        """The stream epx's calls run on: PyTorch's current CUDA stream."""
        return _core.comm_stream("ElasticBuffer.get_comm_stream")

    def get_physical_domain_size(self) -> Tuple[int, int]:
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> Tuple[int, int]:
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0,
                                sm_read_gbs: float = 200, sm_write_gbs: float = 50) -> int:
        """DeepEP's bandwidth model of the SM count (one scale-up domain;
        NVLink 450 GB/s unless given), bounded by the device's SMs (132 on
        a machine without CUDA)."""
        assert num_scaleout_topk == 0
        W = self.num_ranks
        nvlink_gbs = nvlink_gbs or 450.0
        expected = W * (1 - math.comb(num_experts - num_experts // W, num_topk)
                        / math.comb(num_experts, num_topk))
        sm_read = 1 / expected
        sm_write = W / W
        traffic = 1 - 1 / W
        device_sms = (torch.cuda.get_device_properties("cuda").multi_processor_count
                      if torch.cuda.is_available() else 132)
        num_sms = device_sms
        if traffic > 0:
            num_sms = max(nvlink_gbs / traffic * sm_read / sm_read_gbs,
                          nvlink_gbs / traffic * sm_write / sm_write_gbs)
        num_sms = max(4, math.ceil(num_sms * 1.25))
        num_sms += num_sms % 2
        num_sms = num_sms if self.prefer_overlap_with_compute else max(num_sms, 64)
        return min(num_sms, device_sms)

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        num_qps = num_sms * 16 + 1 if self.allow_hybrid_mode else min(num_sms, 9)
        return min(num_qps, self.num_allocated_qps)

    @_core.opaque
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 num_experts: Optional[int] = None, num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event: Optional[EventHandle] = None,
                 previous_event_before_epilogue: Optional[EventHandle] = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = True,
                 do_cpu_sync: Optional[bool] = None, do_expand: bool = False,
                 do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False):
        """DeepEP's V2 dispatch -> (recv_x (a tuple for fp8 x), recv_topk_idx
        [N, K] int64 local ids or None when expanded, recv_topk_weights
        ([N, K], or [N_expanded] when expanded; None without topk_weights),
        handle, event). The rows are exactly the received ones (epx knows
        the count on the host; DeepEP's worst-case rows without a CPU sync
        are a prefix-compatible superset)."""
        fn = "ElasticBuffer.dispatch"
        rt = self._rt("dispatch")
        xs, scales = _core.split_x(x, fn)
        for e in (previous_event, previous_event_before_epilogue):
            if e is not None:
                e.current_stream_wait()
        if handle is not None:
            check(isinstance(handle, EPHandle), fn, "handle is a %s; pass an EPHandle",
                  type(handle).__name__)
            check(topk_idx is None, fn, "topk_idx must be None with handle= (the handle's is used)")
            assert do_cpu_sync is None or not do_cpu_sync, 'Cannot do CPU sync with cached handle'
            num_experts = handle.num_experts if num_experts is None else num_experts
            expert_alignment = (handle.expert_alignment if expert_alignment is None
                                else expert_alignment)
            mt = (handle.num_max_tokens_per_rank if num_max_tokens_per_rank is None
                  else num_max_tokens_per_rank)
            assert (num_experts, expert_alignment, mt) == \
                (handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank)
            do_cpu_sync = handle.cpu_synced
            L = handle.layout
            recv_x, recv_s = rt.cached(L, xs, scales, fn)
            recv_w = None
            if topk_weights is not None:
                check(topk_weights.dtype == torch.float32
                      and tuple(topk_weights.shape) == (L.T, L.K), fn,
                      "topk_weights must be float32 [%d, %d]", L.T, L.K)
                recv_w = rt.to_receivers(L, topk_weights)
                recv_w = torch.where(L.recv_idx >= 0, recv_w, 0.0)
            h = handle
        else:
            T = xs.shape[0]
            _core.check_routing(topk_idx, topk_weights, T, num_experts, fn)
            num_experts = int(num_experts)
            check(num_experts % self.num_ranks == 0, fn, "num_experts %d is not a multiple "
                  "of the %d ranks", num_experts, self.num_ranks)
            expert_alignment = 1 if expert_alignment is None else int(expert_alignment)
            check(expert_alignment >= 1, fn, "expert_alignment must be >= 1")
            mt = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None \
                else num_max_tokens_per_rank
            if not mt:
                mt = self.num_max_tokens_per_rank = rt.agree_tokens(T)
            check(T <= mt, fn, "%d tokens but num_max_tokens_per_rank is %d", T, mt)
            rt.num_sms = num_sms
            cloned = topk_idx.clone() if do_handle_copy else topk_idx
            L, recv_x, recv_s = rt.fresh(xs, scales, topk_idx, topk_weights, num_experts, mt,
                                         fn)
            L.routing_idx = cloned
            recv_w = L.recv_w
            h = EPHandle(do_expand, num_experts, expert_alignment, mt, num_sms, cloned, L)
            do_cpu_sync = True if do_cpu_sync is None else bool(do_cpu_sync)
            if not do_cpu_sync:
                h._no_cpu_sync(self.num_ranks)
        # a tensor of its own, as DeepEP's (callers rewrite it in place: vLLM's globalize)
        recv_idx = None if do_expand else L.recv_idx.to(_core.topk_idx_t, copy=True)
        if do_expand:
            recv_x = _expand_rows(L, expert_alignment, recv_x)
            if recv_s is not None:
                recv_s = _expand_rows(L, expert_alignment, recv_s)
            if recv_w is not None:
                ex = _expansion(L, expert_alignment)
                got = recv_w.reshape(-1).index_select(0, ex["f"])  # recv_w[n, k]
                if ex["dense"]:                        # dest is 0, 1, ... in this order
                    recv_w = got
                else:
                    w = recv_w.new_zeros((ex["total"],))
                    w[ex["dest"]] = got
                    recv_w = w
        if not h.cpu_synced:
            # DeepEP without a CPU sync allocates the worst case: rows past the
            # received ones (psum_num_recv_tokens_per_scaleup_rank[-1], or the
            # experts' prefix sums when expanded) are padding: zeros here, -1 ids
            rows = h.num_expanded_tokens if do_expand else h.num_recv_tokens
            recv_x = _pad(recv_x, rows, 0)
            recv_s = _pad(recv_s, rows, 0)
            recv_idx = _pad(recv_idx, rows, -1)
            recv_w = _pad(recv_w, rows, 0)
        if use_tma_aligned_col_major_sf and recv_s is not None:
            # DeepEP's TMA-aligned column-major scales: stride (1, rows aligned to 4 packs)
            n, S = recv_s.shape
            col = torch.empty_strided((n, S), (1, max(-(-n // 4) * 4, 1)), dtype=recv_s.dtype,
                                      device=recv_s.device)
            recv_s = col.copy_(recv_s)
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += h.num_unaligned_recv_tokens_per_expert.to(
                cumulative_local_expert_recv_stats.dtype)
        event = EventOverlap(EventHandle() if async_with_compute_stream else None)
        out = (recv_x, recv_s) if recv_s is not None else recv_x
        return out, recv_idx, recv_w, h, event

    @_core.opaque
    def combine(self, x: torch.Tensor, handle: EPHandle,
                topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                num_sms: int = 0, num_qps: int = 0, previous_event: EventHandle = None,
                previous_event_before_epilogue: Optional[EventHandle] = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's V2 combine: x ([N, H], or [N_expanded, H] on an expanded
        handle) -> (combined_x [T, H], combined_topk_weights [T, K] or None,
        event). An expanded handle's rows are first summed per source row in
        k order in float32 (DeepEP's reduction within the rank), then over
        the ranks."""
        fn = "ElasticBuffer.combine"
        rt = self._rt("combine")
        check(isinstance(handle, EPHandle), fn, "handle is a %s; pass an EPHandle",
              type(handle).__name__)
        for e in (previous_event, previous_event_before_epilogue):
            if e is not None:
                e.current_stream_wait()
        L = handle.layout
        w = topk_weights
        if handle.do_expand:
            ex = _expansion(L, handle.expert_alignment)
            check(x.dim() == 2 and x.shape[0] >= handle.num_expanded_tokens, fn,
                "x must be [num_expanded_tokens=%d, hidden], not %s",
                handle.num_expanded_tokens, list(x.shape))
            x = _fold(ex, x).to(x.dtype)
            if w is not None:
                check(w.dim() == 1, fn, "topk_weights of an expanded handle must be "
                      "[num_expanded_tokens]")
                folded = torch.zeros((L.rows, L.K), dtype=torch.float32, device=w.device)
                folded.view(-1)[ex["f"]] = w.index_select(0, ex["dest"]).float()  # [n, k]
                w = folded
        out = rt.combine(L, x, fn)
        out = _add_bias(out, bias, L.T, fn)
        cw = rt.to_sources(L, w.float()) if w is not None else None
        event = EventOverlap(EventHandle() if async_with_compute_stream else None)
        return out, cw, event

    # -- out of scope ------------------------------------------------------------

    engram_write = _out_of_scope("engram_write")
    engram_fetch = _out_of_scope("engram_fetch")
    pp_set_config = _out_of_scope("pp_set_config")
    pp_send = _out_of_scope("pp_send")
    pp_recv = _out_of_scope("pp_recv")
    create_agrs_session = _out_of_scope("create_agrs_session")
    destroy_agrs_session = _out_of_scope("destroy_agrs_session")
    agrs_new_session = _out_of_scope("agrs_new_session")
    agrs_set_config = _out_of_scope("agrs_set_config")
    agrs_get_inplace_tensor = _out_of_scope("agrs_get_inplace_tensor")
    all_gather = _out_of_scope("all_gather")

    @staticmethod
    def get_engram_storage_size_hint(*a, **k):
        unsupported("ElasticBuffer.get_engram_storage_size_hint", "Engram is not offered")

    @staticmethod
    def get_pp_buffer_size_hint(*a, **k):
        unsupported("ElasticBuffer.get_pp_buffer_size_hint", "pipeline-parallel send/recv is "
                    "not offered")

    @staticmethod
    def get_agrs_buffer_size_hint(*a, **k):
        unsupported("ElasticBuffer.get_agrs_buffer_size_hint", "AGRS is not offered")
