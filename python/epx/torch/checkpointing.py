"""Activation checkpointing: the ambient recorder (per thread) that the ops
record into, and checkpoint_context, whose recompute replays the recorded
handles."""
import threading

import epx as _epx
from epx import Status
from epx.errors import _refuse
from epx.ownership import _RECORDERS


_ambient = threading.local()
RECORDER_AMBIENT = 0   # recorder_id: the checkpoint_context's recorder, if any
RECORDER_NONE = -1     # recorder_id: never record or replay


def _recorder(recorder_id, fn):
    if recorder_id == RECORDER_NONE:
        return None
    if recorder_id == RECORDER_AMBIENT:
        rec = getattr(_ambient, "recorder", None)
        return rec if rec is not None and not rec.closed else None
    rec = _RECORDERS.get(int(recorder_id))
    if rec is None or rec.closed:
        _refuse(Status.ERROR_INVALID_HANDLE, "%s: recorder %d was closed; pass an open "
                "epx.Recorder", fn, recorder_id)
    return rec


class _RecorderScope:
    """One side of a checkpointed call: the forward records every dispatch's
    handle into the recorder, the recompute replays them in order (no layout
    exchange; validated against the routing) and then closes it. ``stats``
    is the recorder's epx.RecorderStats (its last, once closed)."""

    def __init__(self, recorder, mode, close_after):
        self.recorder, self.mode, self.close_after = recorder, mode, close_after
        self._last = None
        self._previous = None

    @property
    def stats(self):
        return self._last if self.recorder.closed else self.recorder.stats()

    def __enter__(self):
        rec = self.recorder
        if not rec.closed:
            rec.set_mode(self.mode)
        self._previous = getattr(_ambient, "recorder", None)
        _ambient.recorder = rec
        return self

    def __exit__(self, *exc):
        _ambient.recorder = self._previous
        if self.close_after and not self.recorder.closed:
            self._last = self.recorder.stats()
            self.recorder.close()


def checkpoint_context(validate=True):
    """The ``context_fn`` of torch.utils.checkpoint that replays epx handles::

        out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False,
                                                context_fn=epx.torch.checkpoint_context)

    The forward records each dispatch's handle; the recompute in backward
    replays them in order instead of recomputing the layouts (bit-identical
    results; with validate, a recompute that routes differently raises
    epx.ReplayMismatchError naming the call). The recorder is closed when the
    recompute ends (a second backward through the same graph lays out
    afresh)."""
    rec = _epx.Recorder(validate=validate)
    forward = _RecorderScope(rec, _epx.RecorderMode.RECORD, False)
    recompute = _RecorderScope(rec, _epx.RecorderMode.REPLAY, True)
    return forward, recompute
