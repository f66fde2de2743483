"""DeepEP's ``deep_ep.utils``: the events (``from deep_ep.utils import
EventHandle, EventOverlap``, as Megatron and NeMo Automodel import them) and
the helpers DeepEP's tests import (``utils.math``, ``utils.envs``,
``utils.testing``), written for epx."""
from .event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
