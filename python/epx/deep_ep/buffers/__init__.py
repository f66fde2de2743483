"""DeepEP's ``deep_ep.buffers`` (``legacy``: Buffer; ``elastic``:
ElasticBuffer, EPHandle)."""
from .. import elastic, legacy  # noqa: F401
