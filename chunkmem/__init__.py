"""chunkmem: train PyTorch models larger than the GPU's memory by keeping model data in chunks."""

from chunkmem.checkpoint import load_checkpoint, save_checkpoint
from chunkmem.config import Config
from chunkmem.errors import MemoryBudgetError
from chunkmem.wrapper import LOCAL, ChunkedModel, prepare

__all__ = ["LOCAL", "Config", "ChunkedModel", "MemoryBudgetError", "load_checkpoint", "prepare", "save_checkpoint"]
__version__ = "0.1.0"
