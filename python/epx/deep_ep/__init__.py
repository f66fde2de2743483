"""DeepEP's Python API (deep_ep 2.1) on epx: run DeepSpeed AutoEP, NeMo
Automodel, Megatron's flex dispatcher (and any code written for DeepEP)
unchanged, on CPUs, one GPU or many, with NCCL as PyTorch ships it.

- :class:`Buffer` (V1: normal and low-latency modes), :class:`Config`;
- :class:`ElasticBuffer`, :class:`EPHandle` (V2);
- :class:`EventOverlap`, :class:`EventHandle`, ``topk_idx_t`` (torch.int64).

``import deep_ep`` resolves here after :func:`install` (one line before the
framework imports DeepEP), or with the shim directory on PYTHONPATH::

    export PYTHONPATH=$(python -m epx.deep_ep --path):$PYTHONPATH

or by running the script through this module::

    torchrun --nproc-per-node 8 -m epx.deep_ep train.py --args

Each refuses to hide a real DeepEP that is installed, unless forced
(``install(force=True)`` / ``EPX_DEEP_EP=force``). What epx does not offer
raises NotImplementedError naming it (see the README, "Coming from
DeepEP")."""
import importlib.machinery
import importlib.util
import os
import sys

from . import buffers, elastic, legacy, utils
from ._core import stats, topk_idx_t
from .utils import envs as _envs, event as _event, math as _math, testing as _testing
from .elastic import ElasticBuffer, EPHandle
from .legacy import Buffer, Config
from .utils import EventHandle, EventOverlap

__version__ = "2.1.0"
__all__ = ["Buffer", "Config", "ElasticBuffer", "EPHandle", "EventOverlap", "EventHandle",
           "topk_idx_t", "install", "uninstall", "installed", "stats", "get_physical_domain_size",
           "get_logical_domain_size", "shim_path"]

_SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim")
_ALIASES = {"deep_ep": None, "deep_ep.utils": utils, "deep_ep.utils.event": _event,
            "deep_ep.utils.math": _math, "deep_ep.utils.envs": _envs,
            "deep_ep.utils.testing": _testing, "deep_ep.buffers": buffers,
            "deep_ep.buffers.legacy": legacy, "deep_ep.buffers.elastic": elastic}


def get_physical_domain_size():
    """(RDMA domains, NVLink ranks per domain) as DeepEP's environment
    reports them: epx picks its paths per peer, so (1, world size)."""
    import torch.distributed as dist
    return 1, dist.get_world_size() if dist.is_initialized() else 1


get_logical_domain_size = get_physical_domain_size


def shim_path():
    """The directory whose ``deep_ep`` package resolves to epx.deep_ep when
    put on PYTHONPATH."""
    return _SHIM


def _real_deep_ep():
    """The spec of a DeepEP that is not epx's (None if there is none)."""
    path = [p for p in sys.path if os.path.abspath(p or ".") != _SHIM]
    spec = importlib.machinery.PathFinder.find_spec("deep_ep", path)
    return spec


def installed():
    """Whether ``import deep_ep`` gives epx.deep_ep in this process."""
    return sys.modules.get("deep_ep") is sys.modules[__name__]


def install(force=False):
    """Makes ``import deep_ep`` (and ``deep_ep.utils``) resolve to
    epx.deep_ep in this process. Call it before the framework imports
    DeepEP (Megatron decides at import whether DeepEP is there). Refuses
    (RuntimeError) when a real DeepEP is importable or already imported,
    unless force=True."""
    me = sys.modules[__name__]
    if installed():
        return me
    if not force:
        loaded = sys.modules.get("deep_ep")
        spec = _real_deep_ep()
        if loaded is not None or spec is not None:
            where = getattr(loaded, "__file__", None) or (spec.origin if spec else "?")
            raise RuntimeError(
                "epx.deep_ep.install: a real DeepEP is %s (%s); epx will not hide it. Use it, "
                "uninstall it, or call epx.deep_ep.install(force=True) (EPX_DEEP_EP=force for "
                "the shim) to run epx in its place" % (
                    "imported" if loaded is not None else "installed", where))
    for name, module in _ALIASES.items():
        sys.modules[name] = module if module is not None else me
    return me


def uninstall():
    """Undoes :func:`install` (modules that already imported DeepEP's names
    keep them)."""
    for name, module in _ALIASES.items():
        if sys.modules.get(name) is (module if module is not None else sys.modules[__name__]):
            del sys.modules[name]
