"""chunkmem: train PyTorch models larger than the GPU's memory by keeping model data in chunks.

The names below load their modules (and torch) when first used, so that `chunkmem --help` answers at once.
"""

from __future__ import annotations

import importlib
import os as _os
import sys
import types
from typing import TYPE_CHECKING, Any

from chunkmem.version import __version__

if TYPE_CHECKING:
    from chunkmem.checkpoint import load_checkpoint, save_checkpoint
    from chunkmem.config import Config
    from chunkmem.errors import MemoryBudgetError
    from chunkmem.manager import Manager
    from chunkmem.pipeline import Pipeline, pipeline
    from chunkmem.trace import annotate, trace
    from chunkmem.wrapper import LOCAL, ChunkedModel, prepare

_WHERE = {"load_checkpoint": "chunkmem.checkpoint", "save_checkpoint": "chunkmem.checkpoint",
          "Config": "chunkmem.config", "MemoryBudgetError": "chunkmem.errors", "Manager": "chunkmem.manager",
          "Pipeline": "chunkmem.pipeline",
          "pipeline": "chunkmem.pipeline", "annotate": "chunkmem.trace", "trace": "chunkmem.trace",
          "LOCAL": "chunkmem.wrapper", "ChunkedModel": "chunkmem.wrapper", "prepare": "chunkmem.wrapper"}
__all__ = ["LOCAL", "Config", "ChunkedModel", "Manager", "MemoryBudgetError", "Pipeline", "__version__", "annotate",
           "load_checkpoint", "pipeline", "prepare", "save_checkpoint", "trace"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:  # a module of the package, as `chunkmem.zero.collectives` reaches it
        try:
            return importlib.import_module(f"chunkmem.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module 'chunkmem' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """`chunkmem.trace` and `chunkmem.pipeline` are functions, and subpackages have their names: importing one
    binds the package's attribute to the subpackage, which would hide the function users call."""

    @property
    def trace(self) -> Any:
        return importlib.import_module("chunkmem.trace").trace

    @trace.setter
    def trace(self, subpackage: Any) -> None:  # the import system binding chunkmem.trace
        pass

    @property
    def pipeline(self) -> Any:
        return importlib.import_module("chunkmem.pipeline").pipeline

    @pipeline.setter
    def pipeline(self, subpackage: Any) -> None:
        pass


sys.modules[__name__].__class__ = _Package


if _os.environ.get("CHUNKMEM_TRACE", "") not in ("", "0"):  # tracing with no code change (chunkmem/trace/autoattach.py)
    from chunkmem.trace.autoattach import install_from_env as _install_trace

    _install_trace()
