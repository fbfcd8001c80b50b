"""``eb+``: switch online between exclusive batching and mixed batching (seed 002 section 3.5; POLICIES.md 1.6).

Each step runs exclusive (the ``eb`` policy's plan) when

    beta_mix(rho) - beta_bar(rho) > R(N_eff) + delta

and mixed (the ``vllm`` policy's chunked-prefill plan) otherwise, where

* ``rho`` is the decode share of the workload's tokens, ``mu_out / (mu_in + mu_out)`` over the window of
  recently finished requests (before enough have finished: a token-weighted EMA over steps);
* ``beta_bar(rho) = (1 - rho) * beta_p + rho * beta_d``: the exclusive per-token costs, fitted online from
  this unit's decode-only and prefill-only steps (:class:`PhaseCostEstimator`);
* ``beta_mix(rho)``: the per-token cost of a mixed step at share ``rho``: the quadratic fitted online to
  measured mixed steps once the estimator has enough of them; before that, the calibrated prior
  ``beta_bar(rho) * (1 + k * rho * (1 - rho))`` with ``k`` the unit's calibrated mixed-step interference
  (``UnitView.mixed_interference``, fitted per hardware and model from the calibration records);
* ``R(N_eff)``: the fixed-cost advantage of mixing per token (:func:`mixing_advantage_per_token`, derived
  there), with ``theta*``, ``t*``, ``mu_in`` and ``mu_out`` from the ``eb`` policy's window and ``N_eff`` an
  EMA of running requests. Until ``min_samples`` requests have finished, ``R`` is unknown and EB+ mixes;
* ``delta`` (``margin_us``, microseconds per token): the operator's priority margin, < 0 favours mixed
  (lower TTFT), > 0 favours exclusive (throughput).

At low load ``N_eff`` is small, ``R`` is large and EB+ mixes; under saturation on hardware with strong
prefill-decode interference the gap wins and it runs exclusive. The switch happens between steps; the
``eb`` policy keeps its phase state across mixed stretches, and both sub-policies see every step's feedback.
"""

from __future__ import annotations

import math
from collections import deque
from typing import ClassVar

from policies._compiled import mypyc_attr
from policies.base import BatchPolicy
from policies.batch.eb_model import PhaseCosts, mixing_advantage_per_token
from policies.batch.exclusive import EB_PARAMS, ExclusiveBatching
from policies.batch.vllm_default import VllmDefault
from policies.params import ParamSpec
from policies.types import StepFeedback, StepPlan, UnitView

RHO_MARGIN = 0.05
"""How far outside the decode shares of the fitted mixed steps the fitted ``beta_mix`` is still trusted."""


@mypyc_attr(allow_interpreted_subclasses=True)  # plugins subclass shipped policies
class HybridEB(BatchPolicy):
    """EB+: exclusive or mixed, per step, by the crossover rule."""

    name: ClassVar[str] = "eb+"
    summary: ClassVar[str] = "EB+: exclusive or mixed batching per step by the EB/MB crossover rule (seed 002)"
    params_schema: ClassVar[tuple[ParamSpec, ...]] = (
        ParamSpec(
            "margin_us", "float", 0.0,
            "priority margin delta: < 0 favours mixed (TTFT), > 0 favours exclusive (throughput)",
            unit="us/token", min=-1e6, max=1e6,
        ),
        ParamSpec("ema", "float", 0.05, "EMA weight of the newest step for rho and N_eff", min=1e-4, max=1.0),
        ParamSpec(
            "mode", "str", "auto", "auto (the crossover rule), or force exclusive / mixed",
            choices=("auto", "exclusive", "mixed"),
        ),
        *EB_PARAMS,
    )

    def configure(self) -> None:
        p = self.params
        self.margin_s = float(p["margin_us"]) * 1e-6
        self.ema = float(p["ema"])
        self.force = str(p["mode"])
        eb_params = {spec.name: p[spec.name] for spec in EB_PARAMS}
        if not hasattr(self, "eb"):
            self.eb = ExclusiveBatching(eb_params)
            self.mixed = VllmDefault()
            self._decode_ema = 0.0
            self._tokens_ema = 0.0
            self._n_eff: float | None = None
            self.exclusive = False
            self._mixed_rhos: deque[float] = deque(maxlen=512)
            self._rho_range = (1.0, 0.0)
            self._rho_stale = 0
        else:
            self.eb.update_params({k: v for k, v in eb_params.items() if self.eb.params[k] != v})

    @property
    def rho(self) -> float:
        """Decode share of the workload's tokens: ``mu_out / (mu_in + mu_out)`` over the length window once
        it holds ``min_samples`` requests (the steady-state share the crossover's derivation uses), before
        that the token-weighted EMA over steps. A step EMA alone would be biased by EB's own phases: a long
        decode phase drives it towards 1 whatever the workload."""
        window = self.eb.window
        if self.eb.ready:
            total = window.mean_prompt + window.mean_output
            return window.mean_output / total if total > 0 else 0.0
        return self._decode_ema / self._tokens_ema if self._tokens_ema > 0 else 0.0

    def observe_step(self, feedback: StepFeedback) -> None:
        self.eb.observe_step(feedback)
        if feedback.num_decode_tokens and feedback.num_prefill_tokens:
            self._mixed_rhos.append(feedback.decode_share)
            self._rho_stale += 1
        w = self.ema
        self._decode_ema += w * (feedback.num_decode_tokens - self._decode_ema)
        self._tokens_ema += w * (feedback.new_tokens - self._tokens_ema)

    def beta_mix(self, costs: PhaseCosts, rho: float, interference: float) -> tuple[float, str]:
        """``beta_mix(rho)`` and where it came from: the online quadratic fit, or the calibrated prior.

        The fit is used only inside the range of decode shares it was fitted on (widened by
        ``RHO_MARGIN``): a quadratic fitted on the small shares of low-load mixed steps says nothing about
        the workload's share, and extrapolating it gave per-token costs 30 times the exclusive ones.
        """
        estimator = self.eb.estimator
        if estimator is not None and estimator.status.mixed_fit != "prior":
            if self._rho_stale >= 16:
                self._rho_range = (min(self._mixed_rhos), max(self._mixed_rhos))
                self._rho_stale = 0
            lo, hi = self._rho_range
            if lo - RHO_MARGIN <= rho <= hi + RHO_MARGIN:
                return costs.beta_mix(rho), "fitted"
        return costs.beta_bar(rho) * (1.0 + interference * rho * (1.0 - rho)), "calibrated"

    def plan(self, unit: UnitView, now_s: float) -> StepPlan:
        n_run = float(len(unit.running) + min(len(unit.waiting), unit.max_num_seqs - len(unit.running)))
        self._n_eff = n_run if self._n_eff is None else self._n_eff + self.ema * (n_run - self._n_eff)
        self.eb.refresh_if_due(unit)
        assert self.eb.estimator is not None
        costs = self.eb.estimator.costs()
        rho = self.rho
        window = self.eb.window
        if self.eb.ready:
            r_adv = mixing_advantage_per_token(
                costs, self.eb.theta, self.eb.t_star(), self._n_eff, window.mean_prompt, window.mean_output
            )
        else:
            r_adv = math.inf
        beta_mix, source = self.beta_mix(costs, rho, unit.mixed_interference)
        beta_bar = costs.beta_bar(rho)
        gap = beta_mix - beta_bar
        rule = gap > r_adv + self.margin_s
        exclusive = rule if self.force == "auto" else self.force == "exclusive"
        switched = exclusive != self.exclusive
        self.exclusive = exclusive
        inner = self.eb.plan(unit, now_s) if exclusive else self.mixed.plan(unit, now_s)
        reasons = dict(inner.reasons)
        reasons.update(
            {
                "batching": "exclusive" if exclusive else "mixed",
                "batching_switched": switched,
                "rho": round(rho, 4),
                "n_eff": round(self._n_eff, 2),
                "gap_us": round(gap * 1e6, 4),
                "r_adv_us": round(r_adv * 1e6, 4) if math.isfinite(r_adv) else "inf",
                "margin_us": self.margin_s * 1e6,
                "beta_mix_us": round(beta_mix * 1e6, 4),
                "beta_mix_source": source,
                "beta_bar_us": round(beta_bar * 1e6, 4),
                "rule_exclusive": rule,
            }
        )
        return StepPlan(inner.entries, inner.running_order, inner.mode, inner.token_budget, reasons)
