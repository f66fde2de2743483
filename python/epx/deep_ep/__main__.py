"""python -m epx.deep_ep script.py [args]: runs the script with
``import deep_ep`` resolved to epx.deep_ep (torchrun: ``torchrun ... -m
epx.deep_ep script.py``). ``python -m epx.deep_ep --path`` prints the shim
directory for PYTHONPATH. EPX_DEEP_EP=force runs epx even where a real
DeepEP is installed."""
import os
import runpy
import sys

import epx.deep_ep as _ep


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(sys.argv) >= 2 else 2
    if sys.argv[1] == "--path":
        print(_ep.shim_path())
        return 0
    _ep.install(force=os.environ.get("EPX_DEEP_EP") == "force")
    sys.argv = sys.argv[1:]
    if sys.argv[0] == "-m":
        sys.argv = sys.argv[1:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
        runpy.run_path(sys.argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
