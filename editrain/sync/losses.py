"""Each replica's training loss between rounds (the sync log's ``replica_loss``).

The caller records its step losses (:meth:`LossTracker.record`); every round that opens
takes their mean since the previous round (:meth:`LossTracker.take`), and the round's
statistics gather carries it to every replica. The sum stays on the device (float64), so
recording never synchronises with the host.
"""

from __future__ import annotations

from typing import Any

import torch


class LossTracker:
    """This rank's training losses since the last round opened.

    Args:
        device: where the running sum lives (the model's device).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sum: torch.Tensor | None = None
        """The running sum (float64; None: never tracked, no loss travels with rounds)."""
        self.steps = 0

    @property
    def tracking(self) -> bool:
        """Whether rounds carry each replica's loss (:meth:`track` was called)."""
        return self.sum is not None

    def track(self) -> None:
        """Make every round carry a loss from now on (NaN until one is recorded)."""
        if self.sum is None:
            self.sum = torch.zeros((), dtype=torch.float64, device=self.device)
            self.steps = 0

    def record(self, loss: torch.Tensor | float) -> None:
        """Add one step's loss (tracking starts here if it had not)."""
        value = (loss.detach().to(torch.float64).reshape(()) if isinstance(loss, torch.Tensor)
                 else torch.tensor(float(loss), dtype=torch.float64))
        self.track()
        assert self.sum is not None
        self.sum = self.sum + value.to(self.device)
        self.steps += 1

    def take(self) -> torch.Tensor | None:
        """The mean of the losses recorded since the last call (NaN if none was), and a
        fresh count; None when not tracking."""
        if self.sum is None:
            return None
        mean = (self.sum / self.steps if self.steps
                else torch.full((), float("nan"), dtype=torch.float64, device=self.device))
        self.sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.steps = 0
        return mean

    def state_dict(self) -> dict[str, Any] | None:
        """Plain data (None when not tracking)."""
        return None if self.sum is None else {"sum": float(self.sum), "steps": self.steps}

    def load_state_dict(self, sd: dict[str, Any] | None) -> None:
        """Inverse of :meth:`state_dict` (None leaves the tracker as it is)."""
        if sd is not None:
            self.sum = torch.tensor(float(sd["sum"]), dtype=torch.float64, device=self.device)
            self.steps = int(sd["steps"])
