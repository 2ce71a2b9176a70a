"""Errors chunkmem raises for problems a user can fix.

Each message says what happened, the numbers involved and what to change.
"""


# What to change when activations and temporaries leave too little of the device budget for chunks.
ACTIVATION_FIXES = ("raise device_memory, lower the batch size or sequence length, checkpoint activations "
                    "(model.gradient_checkpointing_enable() on a Hugging Face model) or offload them "
                    "(Config(offload_activations=True))")


class MemoryBudgetError(RuntimeError):
    """The memory budget cannot hold what one training step needs at once."""


class ChunkStateError(RuntimeError):
    """A chunk or tensor was asked to make a move its current state forbids (a bug, not a user error)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this model and optimizer; the message names the file and key."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose files are unreadable, incomplete or fail their checksums (a crash, a bad disk)."""


class DiskTierError(RuntimeError):
    """The disk tier (Config.disk) failed: a read or write, a file changed under the run, a full or slow disk.
    The message names the file; the run cannot go on, and its last checkpoint still loads."""
