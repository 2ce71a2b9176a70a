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
        this scaler's, or None: every field, each a finite number within torch.amp.GradScaler's bounds."""
        if not isinstance(saved, dict) or set(saved) != set(vars(self)):
            return f"expected the fields {sorted(vars(self))}"
        bad = [f"{k}={v!r}" for k, v in saved.items()
               if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)]
        if bad:
            return f"{', '.join(bad)}, expected finite numbers"
        interval, good = saved["interval"], saved["good_steps"]
        bounds = {"scale": saved["scale"] > 0, "growth": saved["growth"] > 1, "backoff": 0 < saved["backoff"] < 1,
                  "interval": interval >= 1 and interval == int(interval),
                  "good_steps": 0 <= good < interval and good == int(good)}
        expected = {"scale": "above 0", "growth": "above 1", "backoff": "between 0 and 1",
                    "interval": "a whole number of at least 1", "good_steps": "a whole number below the interval"}
        return next((f"{k}={saved[k]!r}, expected {expected[k]}" for k, ok in bounds.items() if not ok), None)
