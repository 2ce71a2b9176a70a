"""Where each parameter lives: packing parameters into fixed-size chunks, and choosing that size.

Pure functions over (name, numel) lists, so the layout is tested without tensors. The same slot
(chunk index, offset) addresses a parameter in every chunk family: low-precision params, gradients,
fp32 master weights and each optimizer state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

ALIGN = 64  # elements: a multiple of every vector width, fine-grained enough for small models
# Multiples of the largest parameter between which `chunkmem plan --chunk-sizes` takes a size each: finer chunks let a
# budget hold just what it needs, coarser ones make fewer groups to step and move.
CHUNK_BANDS = ((1.0, 1.5), (1.5, 2.0), (2.0, 3.0), (3.0, 4.0))


@dataclasses.dataclass(frozen=True)
class Slot:
    """One parameter's place: chunk `chunk` of its group, elements [offset, offset + numel)."""

    name: str
    chunk: int
    offset: int
    numel: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """Parameters packed in order into `num_chunks` chunks of `chunk_size` elements each."""

    chunk_size: int
    slots: tuple[Slot, ...]
    num_chunks: int

    @property
    def wasted(self) -> int:
        return self.num_chunks * self.chunk_size - sum(s.numel for s in self.slots)

    def members(self, chunk: int) -> list[Slot]:
        return [s for s in self.slots if s.chunk == chunk]


def pack(params: Sequence[tuple[str, int]], chunk_size: int, multiple_of: int = 1) -> Layout:
    """Pack parameters in the given order; a parameter that does not fit opens the next chunk.

    The chunk count is rounded up to `multiple_of` (the world size, so chunks shard evenly).
    """
    for name, numel in params:
        if numel > chunk_size:
            raise ValueError(f"parameter {name!r} has {numel} elements, more than chunk_size={chunk_size}: "
                             f"set Config.chunk_size to at least {numel} or leave it None to search")
    slots, chunk, used = [], 0, 0
    for name, numel in params:
        if used + numel > chunk_size:
            chunk, used = chunk + 1, 0
        slots.append(Slot(name, chunk, used, numel))
        used += numel
    count = chunk + 1 if slots else 0
    return Layout(chunk_size, tuple(slots), math.ceil(count / multiple_of) * multiple_of)


def search_chunk_size(params: Sequence[tuple[str, int]], multiple_of: int = 1, steps: int = 32,
                      fits: Callable[[int], bool] = lambda size: True, span: tuple[float, float] = (1.0, 2.0)) -> int:
    """The chunk size in [largest, 2 x largest] (aligned) that wastes the fewest elements.

    Never below the largest parameter; capped at twice it so that chunks stay fine-grained enough
    for a budget to hold a few of them. Sizes for which `fits` is false are taken only when no
    size fits (the budget check then explains why). Ties go to the smaller size. `span`: other multiples of the
    largest parameter to search between (`chunk_size_bands`).
    """
    return min(chunk_size_candidates(params, steps, span),
               key=lambda size: (not fits(size), pack(params, size, multiple_of).wasted, size))


def chunk_size_candidates(params: Sequence[tuple[str, int]], steps: int = 32,
                          span: tuple[float, float] = (1.0, 2.0)) -> list[int]:
    """The sizes `search_chunk_size` chooses among, smallest first."""
    largest = _align(max((numel for _, numel in params), default=1))
    low, high = _align(int(largest * span[0])), _align(int(largest * span[1]))
    return sorted({_align(low + ((high - low) * k) // steps) for k in range(steps + 1)})


def chunk_size_bands(params: Sequence[tuple[str, int]], multiple_of: int = 1, besides: int | None = None) -> list[int]:
    """The least wasteful size in each band of CHUNK_BANDS, but those within 5% of `besides` or of a smaller one:
    the sizes `chunkmem plan --chunk-sizes` predicts a step for besides the default (search_chunk_size's)."""
    sizes = [besides] if besides is not None else []
    for size in sorted({search_chunk_size(params, multiple_of, span=band) for band in CHUNK_BANDS}):
        if all(abs(size - other) > other * 0.05 for other in sizes):
            sizes.append(size)
    return [size for size in sizes if size != besides]


def _align(n: int) -> int:
    return max(ALIGN, math.ceil(n / ALIGN) * ALIGN)
