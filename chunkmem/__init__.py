"""chunkmem: train PyTorch models larger than the GPU's memory by keeping model data in chunks."""

import os as _os

from chunkmem.checkpoint import load_checkpoint, save_checkpoint
from chunkmem.config import Config
from chunkmem.errors import MemoryBudgetError
from chunkmem.pipeline import Pipeline, pipeline
from chunkmem.trace import annotate, trace
from chunkmem.version import __version__
from chunkmem.wrapper import LOCAL, ChunkedModel, prepare

__all__ = ["LOCAL", "Config", "ChunkedModel", "MemoryBudgetError", "Pipeline", "annotate", "load_checkpoint",
           "pipeline", "prepare", "save_checkpoint", "trace"]

if _os.environ.get("CHUNKMEM_TRACE", "") not in ("", "0"):  # tracing with no code change (chunkmem/trace/autoattach.py)
    from chunkmem.trace.autoattach import install_from_env as _install_trace

    _install_trace()
