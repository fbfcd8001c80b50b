"""The step-time model shared by policies and the simulator.

A step of one DP unit costs ``T = a + b * new_tokens + c * context_tokens + d * num_requests`` (POLICIES.md
section 4), where ``new_tokens`` is the number of tokens computed in the step, ``context_tokens`` the sum,
over the scheduled requests, of the tokens already computed plus the tokens computed in this step (the
definition the calibration records in ``shared/calibration`` use), and ``num_requests`` the number of
requests scheduled in the step.

``d`` is the engine loop's time per scheduled request outside the forward pass (vLLM's output processing:
detokenizing, stop checks, building each request's output), about 8 us per request for Llama-3.1-8B on an
H100 (the profiles' ``loop_overhead_us_per_request``). The calibration records time ``schedule()`` to
``update_from_output()`` and so leave it out; it is fitted per profile from each workload's wall time minus
its summed step times. It defaults to 0, which is the three-term model ``a + b * new + c * ctx`` that most
policies use: ``StepCoefficients(a, b, c)`` and ``predict_s(new, ctx)`` mean what they always meant.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.frozen import fast_init, picklable


@fast_init
@dataclass(frozen=True, slots=True)
class StepCoefficients:
    """Coefficients of ``T = a + b * new_tokens + c * context_tokens + d * num_requests``, all in seconds."""

    a_s: float
    """Fixed cost of a step (seconds)."""
    b_s: float
    """Cost per token computed in the step (seconds per token)."""
    c_s: float
    """Cost per context token of the scheduled requests (seconds per token)."""
    d_s: float = 0.0
    """Engine-loop cost per scheduled request, outside the forward pass (seconds per request; 0 = not known)."""

    def predict_s(self, new_tokens: int, context_tokens: int, num_requests: int = 0) -> float:
        """Predicted duration of a step, in seconds (``num_requests`` scheduled requests; 0 leaves ``d`` out)."""
        return self.a_s + self.b_s * new_tokens + self.c_s * context_tokens + self.d_s * num_requests


picklable(StepCoefficients)  # compiled with mypyc (setup.py): see picklable
