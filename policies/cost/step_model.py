"""The step-time model shared by policies and the simulator.

A step of one DP unit costs ``T = a + b * new_tokens + c * context_tokens`` (POLICIES.md section 4), where
``new_tokens`` is the number of tokens computed in the step and ``context_tokens`` the sum, over the
scheduled requests, of the tokens already computed plus the tokens computed in this step (the definition the
calibration records in ``shared/calibration`` use).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepCoefficients:
    """Coefficients of ``T = a + b * new_tokens + c * context_tokens``, all in seconds."""

    a_s: float
    """Fixed cost of a step (seconds)."""
    b_s: float
    """Cost per token computed in the step (seconds per token)."""
    c_s: float
    """Cost per context token of the scheduled requests (seconds per token)."""

    def predict_s(self, new_tokens: int, context_tokens: int) -> float:
        """Predicted duration of a step, in seconds."""
        return self.a_s + self.b_s * new_tokens + self.c_s * context_tokens
