"""Expert placement and replicas (elastic expert parallelism; epx.h, "Expert
placement and replicas"): :class:`Placement` (which rank holds each physical
expert and which logical expert it serves, the replica rule), the planner
(:meth:`Placement.plan`, DeepSeek's EPLB scheme) and its load model
(:meth:`Placement.rank_load`, :meth:`Placement.skew`), and the weight move
to a new placement (:func:`placement_move`). A buffer takes a placement at
creation (``Buffer(comm, ..., placement=)``); its load counts
(``Buffer.expert_load``) feed the planner, and ``Buffer.replica_grad_sum``
keeps the replicas of an expert equal in training.

Routing stays in logical experts [0, E); a buffer moves rows to physical
experts [0, P), P >= E, P / W on every rank. Every call here works on host
memory (numpy arrays). CUDA buffers take a placement too (their
low-latency mode the contiguous map only); that side has not yet run on a
GPU.
"""
import ctypes

import numpy as np

from ._lib import lib, PlacementStruct, ReplicaRule
from .arrays import empty
from .errors import _c_int, _check, _invalid, EpxError


def _index_array(a, fn, name, length=None):
    """A 1-D integer sequence as a fresh int32 array, refused by name when
    it is not one (floats, bools, values outside int32)."""
    arr = np.asarray(a)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        if not (arr.size == 0 and arr.dtype == np.float64):  # [] has dtype float64
            _invalid("%s: %s has dtype %s; pass a 1-D sequence of integers", fn, name, arr.dtype)
    if arr.ndim != 1:
        _invalid("%s: %s has shape %s; pass a 1-D sequence of integers", fn, name,
                 list(arr.shape))
    if length is not None and arr.shape[0] != length:
        _invalid("%s: %s has %d entries; expected %d (one per physical expert)", fn, name,
                 arr.shape[0], length)
    if arr.size and (arr.min() < -2 ** 31 or arr.max() > 2 ** 31 - 1):
        _invalid("%s: %s has a value outside int32", fn, name)
    out = empty(arr.shape, np.int32)
    out[...] = arr
    out.flags.writeable = False
    return out


def _load_array(load, fn, name="load", length=None):
    """A load vector as a contiguous float64 array: 1-D, real numbers
    (counts or loads; a torch CPU tensor too), finite and >= 0."""
    if hasattr(load, "detach") and hasattr(load, "cpu"):  # a torch tensor
        load = load.detach().cpu().numpy()
    arr = np.asarray(load)
    if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.integer)
                                     or np.issubdtype(arr.dtype, np.floating)):
        _invalid("%s: %s has dtype %s; pass a 1-D array of loads (float or integer counts)", fn,
                 name, arr.dtype)
    if arr.ndim != 1 or arr.shape[0] == 0:
        _invalid("%s: %s has shape %s; pass a 1-D array of one load per logical expert", fn,
                 name, list(arr.shape))
    if length is not None and arr.shape[0] != length:
        _invalid("%s: %s has %d entries; expected %d (num_experts)", fn, name, arr.shape[0],
                 length)
    out = np.ascontiguousarray(arr, dtype=np.float64)
    bad = np.flatnonzero(~np.isfinite(out) | (out < 0))
    if bad.size:
        _invalid("%s: %s[%d] is %r; loads are finite and >= 0", fn, name, bad[0], out[bad[0]])
    return out


class Placement:
    """Where the physical experts live and which logical expert each serves
    (epx_placement_t).

    physical_to_logical [P]: the logical expert of each physical expert
    (every logical expert at least once; a logical expert's replicas are its
    physical experts in ascending id). physical_rank [P] or None: the rank
    holding each (None: p // (P / W), numbered rank by rank as DeepSeek's and
    vLLM's maps). replica_rule: ReplicaRule.ROUND_ROBIN (routing names
    logical experts; a route goes to replica (token + source rank) mod n) or
    ReplicaRule.CALLER (routing names physical ids). num_experts: E, the
    logical experts (default: the largest logical id + 1). num_ranks: the
    comm size it is meant for (None: any size dividing P; a buffer or a move
    over another size is refused).

    Immutable: its arrays are read-only int32 copies."""

    def __init__(self, physical_to_logical, physical_rank=None,
                 replica_rule=ReplicaRule.ROUND_ROBIN, *, num_experts=None, num_ranks=None):
        fn = "epx.Placement"
        p2l = _index_array(physical_to_logical, fn, "physical_to_logical")
        P = p2l.shape[0]
        if P == 0:
            _invalid("%s: physical_to_logical is empty; pass one logical expert per physical "
                     "expert", fn)
        try:
            self.replica_rule = ReplicaRule(int(replica_rule))
        except (ValueError, TypeError):
            _invalid("%s: replica_rule is %r; pass epx.ReplicaRule.ROUND_ROBIN or CALLER", fn,
                     replica_rule)
        E = int(p2l.max()) + 1 if num_experts is None else _c_int(num_experts, ctypes.c_int32,
                                                                  fn, "num_experts")
        if E < 1 or E > P:
            _invalid("%s: num_experts is %d with %d physical experts; pass 1 <= num_experts <= "
                     "num_physical", fn, E, P)
        bad = np.flatnonzero((p2l < 0) | (p2l >= E))
        if bad.size:
            _invalid("%s: physical_to_logical[%d] is %d, outside [0, num_experts = %d)", fn,
                     bad[0], p2l[bad[0]], E)
        served = np.bincount(p2l, minlength=E)
        if not served.all():
            _invalid("%s: physical_to_logical serves no replica of logical expert %d; every "
                     "expert needs at least one physical expert", fn, int(np.argmin(served)))
        if num_ranks is not None:
            num_ranks = _c_int(num_ranks, ctypes.c_int32, fn, "num_ranks")
            if num_ranks < 1 or P % num_ranks:
                _invalid("%s: num_ranks is %d; pass a positive divisor of num_physical (%d)", fn,
                         num_ranks, P)
        rank = None
        if physical_rank is not None:
            rank = _index_array(physical_rank, fn, "physical_rank", P)
            W = num_ranks if num_ranks is not None else int(rank.max()) + 1
            if rank.min() < 0 or rank.max() >= W:
                _invalid("%s: physical_rank has %d, outside [0, num_ranks = %d)", fn,
                         int(rank.min() if rank.min() < 0 else rank.max()), W)
            counts = np.bincount(rank, minlength=W)
            if P % W or (counts != P // W).any():
                _invalid("%s: physical_rank puts %d physical experts on rank %d; every rank "
                         "holds exactly num_physical / num_ranks (%d / %d)", fn,
                         int(counts[np.argmax(counts != P // W)]),
                         int(np.argmax(counts != P // W)), P, W)
            num_ranks = W
        self.num_physical, self.num_experts, self.num_ranks = P, E, num_ranks
        self.physical_to_logical, self.physical_rank = p2l, rank
        self._struct = PlacementStruct(P, p2l.ctypes.data,
                                       rank.ctypes.data if rank is not None else None,
                                       int(self.replica_rule))

    # -- construction --------------------------------------------------------

    @classmethod
    def contiguous(cls, num_experts, num_ranks):
        """The default map: rank r holds experts [r*E/W, (r+1)*E/W), no replicas."""
        fn = "epx.Placement.contiguous"
        E = _c_int(num_experts, ctypes.c_int32, fn, "num_experts")
        W = _c_int(num_ranks, ctypes.c_int32, fn, "num_ranks")
        if E < 1 or W < 1 or E % W:
            _invalid("%s: num_experts %d and num_ranks %d; pass num_experts a positive multiple "
                     "of num_ranks", fn, E, W)
        return cls(np.arange(E), num_experts=E, num_ranks=W)

    @classmethod
    def plan(cls, load, num_physical, num_ranks, num_nodes=1, num_groups=1):
        """A placement of num_physical - E redundant experts over num_ranks
        ranks balancing `load` ([E] routes per logical expert, summed over
        the ranks, e.g. from Buffer.expert_load; epx_placement_plan: EPLB's
        packing and a refinement; deterministic, not collective). num_nodes
        > 1 keeps a group's replicas on one node when num_groups (the
        router's expert groups) is a multiple of it. physical_rank is the
        default map (p // (P / W)); the rule round-robin."""
        fn = "epx.Placement.plan"
        arr = _load_array(load, fn)
        E = arr.shape[0]
        E = _c_int(E, ctypes.c_int32, fn, "load's length")
        args = [_c_int(v, ctypes.c_int32, fn, n) for v, n in
                ((num_physical, "num_physical"), (num_ranks, "num_ranks"),
                 (num_nodes, "num_nodes"), (num_groups, "num_groups"))]
        p2l = empty((max(args[0], 1),), np.int32)
        _check(lib.epx_placement_plan(arr.ctypes.data, E, *args, p2l.ctypes.data))
        return cls(p2l, num_experts=E, num_ranks=args[1])

    @classmethod
    def _from_struct(cls, address, num_experts, num_ranks):
        """The Placement an epx_placement_t at `address` describes (a
        BufferConfig given with a raw placement pointer)."""
        s = PlacementStruct.from_address(address)
        P = int(s.num_physical)
        if P < 1 or not s.physical_to_logical:
            return None  # the library refuses it by name at creation
        p2l = np.ctypeslib.as_array(ctypes.cast(s.physical_to_logical,
                                                ctypes.POINTER(ctypes.c_int32)), (P,))
        rank = (np.ctypeslib.as_array(ctypes.cast(s.physical_rank, ctypes.POINTER(ctypes.c_int32)),
                                      (P,)) if s.physical_rank else None)
        return cls(p2l, rank, s.replica_rule, num_experts=num_experts, num_ranks=num_ranks)

    # -- queries -------------------------------------------------------------

    def ranks(self, num_ranks=None):
        """physical_rank as an array [P] (the default map filled in)."""
        W = self._ranks("epx.Placement.ranks", num_ranks)
        if self.physical_rank is not None:
            return self.physical_rank.copy()
        return np.arange(self.num_physical, dtype=np.int32) // (self.num_physical // W)

    def local_experts(self, rank, num_ranks=None):
        """The physical experts of `rank` in slot order (ascending id): the
        experts a buffer's E_local groups hold, [P / W] int32."""
        fn = "epx.Placement.local_experts"
        W = self._ranks(fn, num_ranks)
        rank = _c_int(rank, ctypes.c_int32, fn, "rank")
        if not 0 <= rank < W:
            _invalid("%s: rank is %d; pass a rank in [0, %d)", fn, rank, W)
        return np.flatnonzero(self.ranks(W) == rank).astype(np.int32)

    def local_logical(self, rank, num_ranks=None):
        """The logical expert each of `rank`'s physical experts serves, in
        slot order ([P / W] int32): which expert weights the rank holds."""
        return self.physical_to_logical[self.local_experts(rank, num_ranks)]

    def replicas(self, expert):
        """The physical experts serving logical expert `expert`, ascending."""
        return np.flatnonzero(self.physical_to_logical == int(expert)).astype(np.int32)

    def rank_load(self, load, num_ranks=None):
        """The load each rank gets when a logical expert's load is shared
        equally by its replicas (the round-robin rule's expectation;
        epx_placement_rank_load): [W] float64."""
        fn = "epx.Placement.rank_load"
        return _rank_load(self, self.num_experts, self._ranks(fn, num_ranks), load, fn)

    def skew(self, load, num_ranks=None):
        """max(rank_load) / mean(rank_load): 1.0 is perfect balance."""
        return _skew(self.rank_load(load, num_ranks))

    @property
    def is_contiguous(self):
        """Whether this is the default map (P = E, identity, round-robin)."""
        if self.num_physical != self.num_experts or self.replica_rule != ReplicaRule.ROUND_ROBIN:
            return False
        if not (self.physical_to_logical == np.arange(self.num_physical)).all():
            return False
        return self.physical_rank is None or (
            self.physical_rank == self.ranks(self.num_ranks)).all()

    def _ranks(self, fn, num_ranks):
        """The comm size a question is about: num_ranks, else the
        placement's own; refused by name when neither fits."""
        if num_ranks is None:
            if self.num_ranks is None:
                _invalid("%s: num_ranks is None and the placement has no num_ranks of its own; "
                         "pass the comm size", fn)
            return self.num_ranks
        W = _c_int(num_ranks, ctypes.c_int32, fn, "num_ranks")
        if W < 1 or self.num_physical % W or (self.num_ranks is not None and W != self.num_ranks):
            _invalid("%s: num_ranks is %d but the placement is over %s; pass %s", fn, W,
                     "%d ranks" % self.num_ranks if self.num_ranks is not None else
                     "%d physical experts (P / W each)" % self.num_physical,
                     self.num_ranks if self.num_ranks is not None else "a divisor of it")
        return W

    def _for(self, fn, name, num_experts, num_ranks):
        """The struct to pass to a call over num_experts logical experts and
        num_ranks ranks, refused by name where the placement does not fit."""
        if num_experts != self.num_experts:
            _invalid("%s: %s serves %d logical experts but num_experts is %d; plan it for %d",
                     fn, name, self.num_experts, num_experts, num_experts)
        if self.num_physical % num_ranks or (self.num_ranks is not None
                                             and self.num_ranks != num_ranks):
            _invalid("%s: %s is over %s but the comm has %d ranks; plan it for %d", fn, name,
                     "%d ranks" % self.num_ranks if self.num_ranks is not None else
                     "%d physical experts" % self.num_physical, num_ranks, num_ranks)
        return self._struct

    def __eq__(self, other):
        if not isinstance(other, Placement):
            return NotImplemented
        if (self.num_experts != other.num_experts or self.replica_rule != other.replica_rule
                or not np.array_equal(self.physical_to_logical, other.physical_to_logical)):
            return False
        if self.num_ranks is not None and other.num_ranks is not None:
            return (self.num_ranks == other.num_ranks
                    and np.array_equal(self.ranks(), other.ranks()))
        W = self.num_ranks if self.num_ranks is not None else other.num_ranks
        if W is not None:  # one of them has its default map for W ranks
            return np.array_equal(self.ranks(W), other.ranks(W))
        if self.physical_rank is None or other.physical_rank is None:
            return self.physical_rank is None and other.physical_rank is None
        return np.array_equal(self.physical_rank, other.physical_rank)

    __hash__ = None

    def __repr__(self):
        return "<epx.Placement E=%d P=%d%s %s%s>" % (
            self.num_experts, self.num_physical,
            " W=%d" % self.num_ranks if self.num_ranks is not None else "",
            self.replica_rule.name.lower(), " contiguous" if self.is_contiguous else "")


def _rank_load(placement, num_experts, num_ranks, load, fn):
    arr = _load_array(load, fn, length=num_experts)
    out = empty((num_ranks,), np.float64)
    ps = ctypes.byref(placement._struct) if placement is not None else None
    _check(lib.epx_placement_rank_load(ps, num_experts, num_ranks, arr.ctypes.data,
                                       out.ctypes.data))
    return out


def _skew(rank_load):
    mean = float(np.mean(rank_load))
    return float(np.max(rank_load)) / mean if mean > 0 else 1.0


def _placement_arg(p, fn, name):
    if p is not None and not isinstance(p, Placement):
        _invalid("%s: %s is a %s; pass an epx.Placement or None (the contiguous map)", fn, name,
                 type(p).__name__)
    return p


def placement_move(comm, src, old, new, *, num_experts=None, out=None):
    """Moves expert weights to a new placement (epx_placement_move,
    collective over comm; host memory).

    src [P_old / W, ...]: this rank's physical experts under `old` (slot
    order), any dtype, C-contiguous; returns out [P_new / W, ...] (same
    trailing shape and dtype; allocated when None, must not overlap src):
    each physical expert of `new` gets the block of its logical expert, from
    a replica on its own rank where `old` has one. old / new: epx.Placement,
    or None for the contiguous map; num_experts: needed only when both are
    None. A refusal here is a refusal on every rank (the peers get
    PeerFailedError naming this rank)."""
    fn = "epx.placement_move"
    ptr = comm._handle(fn)
    try:
        old = _placement_arg(old, fn, "old")
        new = _placement_arg(new, fn, "new")
        E = _move_experts(fn, old, new, num_experts)
        W = comm.size
        ps_old = old._for(fn, "old", E, W) if old is not None else None
        ps_new = new._for(fn, "new", E, W) if new is not None else None
        if E % W and (old is None or new is None):
            _invalid("%s: num_experts %d is not a multiple of the comm's %d ranks, so there is "
                     "no contiguous map; pass both placements", fn, E, W)
        rows_old = (old.num_physical if old is not None else E) // W
        rows_new = (new.num_physical if new is not None else E) // W
        src, out = _move_arrays(fn, src, out, rows_old, rows_new)
    except EpxError as e:
        if not e.in_library:
            _fail_move_peers(comm)
        raise
    block = src.nbytes // rows_old if rows_old else 0
    _check(lib.epx_placement_move(ptr, E, ctypes.byref(ps_old) if ps_old is not None else None,
                                  ctypes.byref(ps_new) if ps_new is not None else None, block,
                                  src.ctypes.data if src.nbytes else None,
                                  out.ctypes.data if out.nbytes else None))
    return out


def _move_experts(fn, old, new, num_experts):
    """The logical expert count of a move: the placements' (which agree), else num_experts."""
    given = [p.num_experts for p in (old, new) if p is not None]
    if num_experts is not None:
        given.append(_c_int(num_experts, ctypes.c_int32, fn, "num_experts"))
    if not given:
        _invalid("%s: old and new are both None (the contiguous map); pass num_experts", fn)
    if len(set(given)) > 1:
        _invalid("%s: old, new and num_experts disagree on the logical experts (%s); a move "
                 "keeps the experts", fn, ", ".join(map(str, given)))
    if given[0] < 1:
        _invalid("%s: num_experts is %d; pass >= 1", fn, given[0])
    return given[0]


def _move_arrays(fn, src, out, rows_old, rows_new):
    if not isinstance(src, np.ndarray):
        _invalid("%s: src is a %s; pass a numpy array [P / W, ...] of this rank's experts", fn,
                 type(src).__name__)
    if src.ndim < 1 or src.shape[0] != rows_old:
        _invalid("%s: src has shape %s; expected [%d, ...] (old's physical experts per rank)",
                 fn, list(src.shape), rows_old)
    if not src.flags.c_contiguous:
        _invalid("%s: src is not C-contiguous; pass np.ascontiguousarray(src)", fn)
    shape = (rows_new,) + src.shape[1:]
    if out is None:
        return src, empty(shape, src.dtype)
    if not isinstance(out, np.ndarray):
        _invalid("%s: out is a %s; pass a numpy array %s or None", fn, type(out).__name__,
                 list(shape))
    if out.dtype != src.dtype or out.shape != shape:
        _invalid("%s: out is %s %s; expected %s %s (src's dtype, new's experts per rank)", fn,
                 out.dtype, list(out.shape), src.dtype, list(shape))
    if not out.flags.c_contiguous or not out.flags.writeable:
        _invalid("%s: out is not a writable C-contiguous array; pass one (or None)", fn)
    if np.shares_memory(src, out):
        _invalid("%s: out overlaps src; pass separate memory (or out=None)", fn)
    return src, out


def _fail_move_peers(comm):
    """A move refused in Python still meets its peers in the library's
    agreement (with a num_experts the library refuses locally), so that they
    fail at once naming this rank instead of waiting out the timeout."""
    if comm._ptr is not None and comm.size > 1:
        lib.epx_placement_move(comm._ptr, 0, None, None, 0, None, None)
