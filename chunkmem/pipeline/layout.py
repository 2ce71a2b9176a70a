"""Where a rank sits: its place in its pipeline, its pipeline among the data-parallel replicas, the process
groups it talks in, and which of the pipeline's stages it runs.

With data_parallel=D, world = D x K ranks form D pipelines of K ranks; rank r is position r % K of
pipeline r // K. A rank runs one stage, or `virtual` stages under the interleaved and zero-bubble
schedules: stage i of K*v on rank i % K ("loop", as torch's interleaved schedules place them), or, for
ZBV, stages r and 2K-1-r on rank r ("v": the first and the last stage share rank 0).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from chunkmem.wrapper import LOCAL
from chunkmem.zero.collectives import default_group


@dataclasses.dataclass(frozen=True)
class Layout:
    """Rank `position` of pipeline `replica`, and the groups it talks in."""

    position: int
    n_ranks: int  # K: ranks per pipeline
    replica: int
    n_replicas: int
    pipe_group: Any  # the K ranks of this pipeline
    data_group: Any  # the D ranks at this position (chunkmem.LOCAL when D = 1)

    def global_rank(self, position: int) -> int:
        return dist.get_global_rank(self.pipe_group, position)


def make_layout(data_parallel: int, device: str) -> Layout:
    if default_group(None, device) is None:
        raise RuntimeError("chunkmem.pipeline needs one process per stage: launch with torchrun "
                           "(torchrun --nproc-per-node K script.py) or initialise a process group first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1 \
            or world % data_parallel:
        raise ValueError(f"data_parallel={data_parallel} does not divide the world of {world} ranks: "
                         f"use a divisor of {world}")
    k = world // data_parallel
    pipes = [dist.new_group(list(range(p * k, (p + 1) * k))) for p in range(data_parallel)] \
        if data_parallel > 1 else [dist.group.WORLD]
    datas = [dist.new_group(list(range(s, world, k))) for s in range(k)] if data_parallel > 1 else []
    return Layout(rank % k, k, rank // k, data_parallel, pipes[rank // k], datas[rank % k] if datas else LOCAL)


def stage_ranks(n_ranks: int, virtual: int, style: str = "loop") -> list[int]:
    """The pipeline position that runs each of the K*v stages."""
    if style == "v":
        return [s if s < n_ranks else 2 * n_ranks - 1 - s for s in range(2 * n_ranks)]
    return [s % n_ranks for s in range(n_ranks * virtual)]
