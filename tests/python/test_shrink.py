"""Shrink and go on from Python (epx.h: epx_comm_shrink; epx.Comm.shrink):
a local rank that stops is named by its peers' next call within the
timeout, the survivors shrink to a comm of the others (renumbered, the same
lost list on each) and go on; a rank that comes late is refused.

Run: EPX_LIBRARY=build/libepx.so PYTHONPATH=python python -m pytest tests/python/test_shrink.py
"""
import pathlib
import sys
import threading

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python"))

import epx  # noqa: E402


def test_comm_shrink_after_a_stopped_rank():
    world = epx.LocalWorld(3, timeout_seconds=0.5)
    survivors_done = threading.Event()
    results, errors = [None] * 3, [None] * 3

    def rank_main(rank):
        try:
            comm = world.comm(rank)
            comm.barrier()
            if rank == 1:  # stops until the survivors went on
                survivors_done.wait(30)
                with pytest.raises(epx.EpxError) as late:
                    comm.shrink()
                assert late.value.status == epx.Status.ERROR_PEER_FAILED
                comm.close()
                return
            with pytest.raises(epx.EpxError) as lost:
                comm.barrier()
            assert "rank 1" in str(lost.value)
            new, lost_ranks = comm.shrink()
            comm.close()
            got = new.allgather(np.array([rank], np.int32))
            results[rank] = (new.rank, new.size, lost_ranks, got.ravel().tolist())
            new.close()
        except BaseException as e:  # noqa: B902  (reported below)
            errors[rank] = e
        finally:
            if rank != 1 and sum(r is not None for r in results) + sum(e is not None for e in errors) >= 2:
                survivors_done.set()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    world.close()
    for e in errors:
        if e is not None:
            raise e
    assert results[0] == (0, 2, [1], [0, 2])
    assert results[2] == (1, 2, [1], [0, 2])
