"""The communicators: Comm (self, local, MPI, NCCL; allgather, alltoallv,
barrier, buffer), LocalWorld (the ranks of one process as threads) and run_local."""
import ctypes
import threading
import weakref

import numpy as np

from ._lib import CommConfig, lib, Status
from .arrays import empty
from .buffer import Buffer
from .errors import _c_int, _check, _invalid, EpxError
from .ownership import _Closable, _destroy, _released
from .routing import route_agree_capacity, route_sum_counts


def _comm_config(config, fields):
    """A constructor's CommConfig: config with fields over it, or the
    defaults with fields."""
    if config is None:
        return CommConfig(**fields)
    return config.copy(**fields) if fields else config


class Comm(_Closable):
    """A group of ranks (epx_comm_t). Make one with :meth:`create_self`,
    :meth:`LocalWorld.comm` or :meth:`from_mpi`.

    close() is collective for local and MPI comms (every rank closes);
    it closes the comm's buffers first. Garbage collection closes only a
    one-rank comm: a collective close from a collector could wait on peers.
    """

    def __init__(self, _ptr_value, _world=None):
        self._ptr = _ptr_value
        self._world = _world
        self._lock = threading.RLock()
        self._buffers = weakref.WeakSet()
        r, s = ctypes.c_int32(), ctypes.c_int32()
        _check(lib.epx_comm_rank(self._ptr, ctypes.byref(r)))
        _check(lib.epx_comm_size(self._ptr, ctypes.byref(s)))
        self.rank, self.size = r.value, s.value

    @classmethod
    def create_self(cls):
        """A comm of one rank (epx_comm_create_self)."""
        p = ctypes.c_void_p()
        _check(lib.epx_comm_create_self(ctypes.byref(p)))
        return cls(p.value)

    @classmethod
    def from_mpi(cls, mpi_comm, config=None, **fields):
        """The MPI transport over an mpi4py communicator (or the address of an
        MPI_Comm); collective. The library duplicates it."""
        config = _comm_config(config, fields)
        if isinstance(mpi_comm, int):
            address = mpi_comm
        else:
            from mpi4py import MPI
            address = MPI._addressof(mpi_comm)
        p = ctypes.c_void_p()
        _check(lib.epx_comm_create_mpi(address, ctypes.byref(config), ctypes.byref(p)))
        return cls(p.value)

    @classmethod
    def from_shm(cls, name, rank, size, config=None, **fields):
        """The shm transport (epx_comm_create_shm): `size` processes of one
        host meeting in POSIX shared memory under `name` (the same on every
        rank, new for every comm); collective. No MPI needed."""
        config = _comm_config(config, fields)
        p = ctypes.c_void_p()
        rank = _c_int(rank, ctypes.c_int32, "Comm.from_shm", "rank")
        size = _c_int(size, ctypes.c_int32, "Comm.from_shm", "size")
        _check(lib.epx_comm_create_shm(str(name).encode(), rank, size, ctypes.byref(config),
                                       ctypes.byref(p)))
        return cls(p.value)

    def _handle(self, fn):
        if self._ptr is None:
            _released(fn, "comm", "closed; create a new one")
        return self._ptr

    def buffer(self, config=None, **fields):
        """A :class:`Buffer` over this comm (collective)."""
        return Buffer(self, config, **fields)

    def barrier(self):
        """epx_comm_barrier (collective; bounded by the comm's timeout)."""
        _check(lib.epx_comm_barrier(self._handle("Comm.barrier")))

    def allgather(self, send):
        """epx_comm_allgather (collective): every rank's array `send` (the
        same shape and dtype on every rank; any numpy array) -> [size, *shape]
        with block s from rank s."""
        fn = "Comm.allgather"
        a = np.ascontiguousarray(send)
        recv = empty((self.size,) + a.shape, a.dtype)
        _check(lib.epx_comm_allgather(self._handle(fn), a.ctypes.data if a.nbytes else None,
                                      recv.ctypes.data if recv.nbytes else None, a.nbytes))
        return recv

    def alltoallv(self, send, send_counts):
        """A small all-to-all (collective): send [sum(send_counts), *row]
        gives send_counts[r] rows to rank r, in order -> the rows this rank
        gets, by source rank. The row shape and dtype are the same on every
        rank. Made of two allgathers (every rank's counts, then every rank's
        rows padded to the longest): for routing weights and counts beside
        a dispatch, not for payloads."""
        a = np.ascontiguousarray(send)
        counts = np.asarray(send_counts, dtype=np.int64).reshape(-1)
        if counts.shape[0] != self.size or (counts < 0).any() or a.ndim < 1 \
                or int(counts.sum()) != a.shape[0]:
            _invalid("Comm.alltoallv: send_counts %s for %s rows; pass %d counts summing "
                     "to the rows of send", counts.tolist(), list(a.shape), self.size)
        every = self.allgather(counts)                    # [s, r]: rows rank s gives rank r
        padded = np.zeros((int(every.sum(axis=1).max()),) + a.shape[1:], a.dtype)
        padded[:a.shape[0]] = a
        rows = self.allgather(padded)                     # [s, longest, *row]
        starts = np.cumsum(every, axis=1) - every
        r = self.rank
        return np.concatenate([rows[s, starts[s, r]:starts[s, r] + every[s, r]]
                               for s in range(self.size)])

    def shrink(self, config=None, **fields):
        """epx_comm_shrink: after a lost rank (an EpxError naming it), the
        survivors' new :class:`Comm` (renumbered in ascending old rank
        order) and the lost old ranks, the same list on every survivor.
        Collective over the survivors; this comm stays failed: close it (and
        its buffers) afterwards. config/fields: the new comm's (default: this
        comm's timeout)."""
        fn = "Comm.shrink"
        cfg = ctypes.byref(_comm_config(config, fields)) if config is not None or fields else None
        p, n = ctypes.c_void_p(), ctypes.c_int32()
        lost = np.zeros(self.size, np.int32)
        _check(lib.epx_comm_shrink(self._handle(fn), cfg, ctypes.byref(p), lost.ctypes.data, ctypes.byref(n)))
        return Comm(p.value), [int(r) for r in lost[:n.value]]

    def route_agree_capacity(self, expert_counts):
        """:func:`route_agree_capacity` over this comm."""
        return route_agree_capacity(self, expert_counts)

    def route_sum_counts(self, local_counts):
        """:func:`route_sum_counts` over this comm."""
        return route_sum_counts(self, local_counts)

    def close(self):
        """Closes the comm's buffers (and their handles), then the comm
        (epx_comm_destroy, collective). Closing a closed comm does nothing."""
        with self._lock:
            buffers = list(self._buffers)
        for b in buffers:
            b.close()
        _destroy(self, lib.epx_comm_destroy, self._lock)

    def __del__(self):
        try:
            if self._ptr is not None and self.size == 1:
                self.close()
        except Exception:
            pass

    def __repr__(self):
        return "<epx.Comm rank %d of %d%s>" % (self.rank, self.size,
                                               " closed" if self.closed else "")


class LocalWorld(_Closable):
    """W ranks as threads of this process (epx_local_world_create). Each
    rank's thread calls :meth:`comm` with its rank; see :func:`run_local`."""

    def __init__(self, size, config=None, **fields):
        config = _comm_config(config, fields)
        p = ctypes.c_void_p()
        size = _c_int(size, ctypes.c_int32, "LocalWorld", "size")
        _check(lib.epx_local_world_create(size, ctypes.byref(config), ctypes.byref(p)))
        self._ptr = p.value
        self.size = int(size)
        self.config = config.copy()

    def comm(self, rank):
        """This rank's comm (epx_comm_create_local; collective over the world)."""
        if self._ptr is None:
            _released("LocalWorld.comm", "local world", "closed; create a new one")
        p = ctypes.c_void_p()
        rank = _c_int(rank, ctypes.c_int32, "LocalWorld.comm", "rank")
        _check(lib.epx_comm_create_local(self._ptr, rank, ctypes.byref(p)))
        return Comm(p.value, self)

    def close(self):
        """epx_local_world_destroy: after every comm of the world is closed
        (EpxError EPX_ERROR_BUSY otherwise)."""
        _destroy(self, lib.epx_local_world_destroy)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def run_local(world_size, fn, *args, timeout_seconds=None, **kwargs):
    """Runs ``fn(comm, *args, **kwargs)`` on `world_size` ranks of the local
    transport, one Python thread each, and returns the results by rank.

    Each rank's comm is closed when its fn returns (closing what it left
    open). If a rank raises, the exception of the lowest such rank is raised
    once every thread has finished; a rank whose peers stopped answering
    gets EPX_ERROR_TIMEOUT after timeout_seconds (the comm's default when
    None), so keep it short in tests. One rank runs on the calling thread
    with the self comm.
    """
    if world_size == 1:
        with Comm.create_self() as comm:
            return [fn(comm, *args, **kwargs)]
    fields = {} if timeout_seconds is None else {"timeout_seconds": float(timeout_seconds)}
    world = LocalWorld(world_size, **fields)
    results = [None] * world_size
    errors = [None] * world_size

    def rank_main(rank):
        try:
            comm = world.comm(rank)
        except BaseException as e:  # noqa: B902  (reported to the caller below)
            errors[rank] = e
            return
        try:
            results[rank] = fn(comm, *args, **kwargs)
        except BaseException as e:  # noqa: B902
            errors[rank] = e
        finally:
            try:
                comm.close()
            except BaseException as e:  # noqa: B902
                if errors[rank] is None:
                    errors[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,), name="epx-rank-%d" % r, daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [r for r in range(world_size) if errors[r] is not None]
    try:
        world.close()
    except EpxError:
        if not failed:
            raise  # else a rank's own error, raised below, is the cause
    # The cause before its echoes: a rank's own error before peers' TIMEOUT/PEER_FAILED.
    echoes = (Status.ERROR_TIMEOUT, Status.ERROR_PEER_FAILED)
    if failed:
        causes = [r for r in failed if getattr(errors[r], "status", None) not in echoes]
        rank = (causes or failed)[0]
        err = errors[rank]
        if hasattr(err, "add_note"):
            err.add_note("(raised on rank %d of %d in epx.run_local)" % (rank, world_size))
        raise err
    return results
