# epx's stand-in for DeepEP: this directory on PYTHONPATH makes
# `import deep_ep` give epx.deep_ep (see epx.deep_ep's docstring). It refuses
# to hide a real DeepEP found elsewhere on sys.path unless EPX_DEEP_EP=force.
import os as _os
import sys as _sys

del _sys.modules[__name__]
import epx.deep_ep as _epx_deep_ep  # noqa: E402

_epx_deep_ep.install(force=_os.environ.get("EPX_DEEP_EP") == "force")
