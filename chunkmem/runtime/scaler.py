"""Dynamic loss scaling for fp16: scale gradients up in backward, skip steps that overflow."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class LossScaler:
    """The same policy as torch.amp.GradScaler: halve on overflow, double after `interval` good steps."""

    scale: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    interval: int = 2000
    good_steps: int = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.interval:
            self.scale *= self.growth
            self.good_steps = 0
