"""Dynamic loss scaling for fp16: scale gradients up in backward, skip steps that overflow."""

from __future__ import annotations

import dataclasses
import math
from typing import Any


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

    def problem(self, saved: Any) -> str | None:
        """What keeps `saved` (a state as `dataclasses.asdict` gives it, from a state dict or a checkpoint) from being
        this scaler's, or None: every field, each a finite number, above 0 but for the counts."""
        if not isinstance(saved, dict) or set(saved) != set(vars(self)):
            return f"expected the fields {sorted(vars(self))}"
        for name, value in saved.items():
            least = {"interval": 1, "good_steps": 0}.get(name)  # counts
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
                    (value <= 0 if least is None else value < least or value != int(value)):
                return f"{name}={value!r}, expected " + ("a number above 0" if least is None else
                                                          f"a whole number of at least {least}")
        return None
