"""Start-up hook for `chunkmem trace -- COMMAND` (see chunkmem/trace/autoattach.py's Note).

This directory is put first on PYTHONPATH only for the traced command. After starting the trace
it imports the next `sitecustomize` on the path, so an environment's own one still runs.
"""

import importlib
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))

if os.environ.get("CHUNKMEM_TRACE", "") not in ("", "0"):
    try:
        from chunkmem.trace.autoattach import install_from_env

        install_from_env()
    except Exception as error:  # tracing must never stop the user's program from starting
        print(f"chunkmem trace: could not start tracing in this process: {error!r}", file=sys.stderr)

_saved_path = list(sys.path)
try:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    _self = sys.modules.pop("sitecustomize", None)
    try:
        importlib.import_module("sitecustomize")
    except ImportError:
        pass
    finally:
        if _self is not None and "sitecustomize" not in sys.modules:
            sys.modules["sitecustomize"] = _self
finally:
    sys.path[:] = _saved_path
