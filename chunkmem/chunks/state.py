"""The states of tensors and chunks, and the one table of moves between them.

[Note: chunk states]
A chunk owns a host payload; the device payload is a cache of it. A disk-backed chunk (master weights
and optimizer states under a disk tier, chunks/hostcache.py) may give its host payload up for a slot
in the disk tier's file, from HOST only:
  FREE          nothing valid anywhere: the chunk reads as zeros (a gradient chunk after zero_grad).
  HOST          the host payload holds the data; no device copy.
  DEVICE        a device copy exists and equals the host payload (evicting it copies nothing).
  DEVICE_DIRTY  a device copy exists and is newer than the host payload (evicting it copies back).
  DISK          the disk slot holds the data; no host payload, no device copy.
A chunk may drop its device copy only when none of its tensors is in COMPUTE.

[Note: tensor states]
  FREE     no data (a gradient not yet produced in this step).
  HOLD     data at rest in its chunk.
  COMPUTE  in use by a running module; its chunk is pinned on the device. Nested uses count.
"""

from __future__ import annotations

import enum

from chunkmem.errors import ChunkStateError


class ChunkState(enum.Enum):
    FREE = "free"
    HOST = "host"
    DEVICE = "device"
    DEVICE_DIRTY = "device_dirty"
    DISK = "disk"

    on_device: bool  # a device copy exists (read at every chunk access: an attribute, not a property)

    def __init__(self, value: str) -> None:
        self.on_device = value in ("device", "device_dirty")


class TensorState(enum.Enum):
    FREE = "free"
    HOLD = "hold"
    COMPUTE = "compute"


_C = ChunkState
CHUNK_MOVES: dict[tuple[ChunkState, str], ChunkState] = {
    (_C.FREE, "materialize_host"): _C.HOST,
    (_C.FREE, "materialize_device"): _C.DEVICE_DIRTY,
    (_C.HOST, "upload"): _C.DEVICE,
    (_C.HOST, "write_host"): _C.HOST,
    (_C.DEVICE, "write_device"): _C.DEVICE_DIRTY,
    (_C.DEVICE_DIRTY, "write_device"): _C.DEVICE_DIRTY,
    (_C.DEVICE_DIRTY, "download"): _C.DEVICE,
    (_C.DEVICE, "drop_device"): _C.HOST,
    (_C.HOST, "reset"): _C.FREE,
    (_C.DEVICE, "reset"): _C.FREE,
    (_C.DEVICE_DIRTY, "reset"): _C.FREE,
    (_C.FREE, "reset"): _C.FREE,
    (_C.HOST, "spill"): _C.DISK,
    (_C.DISK, "load"): _C.HOST,
    (_C.DISK, "reset"): _C.FREE,
}

_T = TensorState
TENSOR_MOVES: dict[tuple[TensorState, str], TensorState] = {
    (_T.FREE, "write"): _T.HOLD,
    (_T.HOLD, "write"): _T.HOLD,
    (_T.HOLD, "acquire"): _T.COMPUTE,
    (_T.COMPUTE, "acquire"): _T.COMPUTE,
    (_T.COMPUTE, "release"): _T.HOLD,
    (_T.HOLD, "free"): _T.FREE,
    (_T.FREE, "free"): _T.FREE,
}


def next_chunk_state(state: ChunkState, move: str, what: str) -> ChunkState:
    try:
        return CHUNK_MOVES[(state, move)]
    except KeyError:
        raise ChunkStateError(f"{what}: illegal move {move!r} from state {state.name}") from None


def next_tensor_state(state: TensorState, move: str, what: str) -> TensorState:
    try:
        return TENSOR_MOVES[(state, move)]
    except KeyError:
        raise ChunkStateError(f"{what}: illegal move {move!r} from state {state.name}") from None
