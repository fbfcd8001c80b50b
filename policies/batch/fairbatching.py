"""``fairbatching`` and ``fairbatching+pab`` (seed 003; POLICIES.md 1.4).

Envelope and slack. Request i's j-th output token (0-based) is due at ``ddl_ij = t_i + ttft_i + tpot_i * j``
(one line covers TTFT, j = 0, and TPOT). Its next deadline is ``ddl_i = ddl_{i, o_i}``: a request that has
sampled ``o_i`` tokens owes token ``o_i`` next (a new or recomputing request owes its first, or its next,
token the same way). Slack ``s_i = ddl_i - now``. Unlike TBT, an early token never hurts: slack a request
banked while prefills were idle can be spent during a prefill burst (seed 003, section 3.1).

Time budget (Algorithm 1, lines 18-20, 34). ``init = max(min_i s_i, min_i tpot_i)``: the step may last until
the most urgent deadline, but never less than one TPOT (a decode burst would otherwise shrink steps to
nothing). The tokens of a step may use ``B_t = init - a`` seconds (a = the step's fixed cost); the token
budget is only the engine's hard cap (``max_num_batched_tokens``, the CUDA-graph limit).

Groups (lines 21-33). (1) urgent decodes, ``s_i < init + min tpot`` (skipping them this step would likely
miss their deadline next step); (2) prefills (running chunks, recomputes and waiting requests); (3) the
other decodes. Each group sorted by slack ascending; walked in that order.

Cost and chunking (lines 36-47). With the unit's step model ``T = a + b * new + c * ctx + d * requests``
(ctx counts the request's context after the step, the calibration records' definition; ``d`` is the engine
loop's time per scheduled request, ``StepCoefficients.d_s``) request i with ``k_i`` computed tokens costs
``b * n + c * (k_i + n) + d = (b + c) * n + c * k_i + d`` for ``n`` new tokens. It is taken whole when that
fits both budgets; otherwise, if its fixed cost ``c * k_i + d`` fits, a chunk of
``n = min(token_budget, floor((B_t - c * k_i - d) / (b + c)))`` tokens (the paper writes
``(B_t - c * context_i) / b`` with ``context_i`` the old context; ours adds the chunk's own attention
term, as the calibrated model does). What is taken is subtracted from both budgets. The paper's line 45
adds ``c * context_i`` back by a sign slip; we subtract it. Non-urgent decodes that do not fit are held
back: that is how slack is reclaimed for prefill bursts.

Engine loop and margin (not in the paper; issue 19, item 5). The paper's model has no ``d``: a step of 400
short decodes then really lasts 400 * 8.4 us = 3.4 ms (H100 8B) longer than planned. And the planner fills
a step to its deadline exactly, so any step that runs longer than predicted, by however little, makes the
most urgent request's token late, and under seed 003's metric (the worst per-token TPOT) one late token
fails the request. So the step is planned to end ``margin`` before ``init``: ``B_t = init / (1 + q) - a``
with ``q`` the ``margin_quantile`` (0.99) of the relative errors ``measured / predicted - 1`` of the last
256 steps (this policy's own prediction, ``d`` included, against the measured duration in ``observe_step``),
clipped to ``[0, 0.5]``; ``margin_quantile = 0`` is the paper's zero margin. It is refreshed every 16 steps, and
after every step while fewer than 16 errors are in: a new or hot-swapped policy would otherwise plan its first 16
steps to the deadline itself (in the simulated papers run, the first 11 of 60 requests failed by 0.1 ms that way).
And the margin is never below ``margin_floor`` (0.5%, 0.25 ms of a 50 ms TPOT): a request whose tokens the planner
stretches to the TPOT itself fails on any error the window has not seen (after the warm-up fix, 3 of those 60 still
failed, by 8-57 us). Measured (docs/policies.md, "Margin floor"): 1.0 on that window; on 4 units +0.13 req/s
at 90% attainment (its peak effective RPS -1%), on one unit +0.1 to +0.8 points of attainment (+PAB +0.7 to +8.0).
The margin never delays an urgent decode (they are always taken) and the urgent threshold still uses ``init``.
``d`` comes with the coefficients (a profile's ``loop_overhead_us_per_request``); it is 0 where the agent does not
pass it, and then the margin alone absorbs the loop's time, as far as the measured step times contain it.

Anchor (not in the paper; issue 19, items 10 and 11; the default since 2026-11-26). With the paper's envelope
alone (``anchor=arrival``) a request that got its first token early has banked slack, and the planner spends it
by holding the request back for whole prefills: gaps of hundreds of milliseconds between two of its tokens, so
under the paper's own metric (the worst per-token TPOT, 5.1) it misses its SLO although every envelope deadline
was met. The default therefore also bounds token ``j`` by ``first_token + tpot * j`` once the first token is out
(``anchor=first_token``; the earlier of the two deadlines counts). Measured, at seed 003's four corner SLOs on two
workloads (``docs/batch-policies.md``, "SLO strictness"): the arrival anchor lost to tuned Sarathi in all 8 cells
(-10% to -94% peak effective RPS), the first-token anchor gained in 7 (to +19%; with PAB to +28%). On an H100 the
arrival anchor lost on the real engine as the simulator predicted (``docs/vllm.md``). The first-token anchor lost
there too (0.15-0.50 attainment against the simulator's 0.82), because of two defects in the vLLM scheduler under async
scheduling, not in this policy: it planned a step from "now" while the step in flight ran on, and it saw no first-token
time for a first token still in flight. Both are fixed: on the H100 afterwards it met 0.82-0.85 of the SLOs, what the
simulator predicted (0.82), under async and sync scheduling alike.

Decisions where the paper is silent (tested):

* Urgent decodes are always taken, even past the time budget (the paper: "FairBatching conservatively
  ensures that urgent decode tasks are always included"; under extreme load it degrades to Sarathi).
* Preemption order (``running_order``): the walk order, so the victim when KV runs out is the running
  request with the most slack in the last group.
* Waiting requests: only the first ``waiting_scan`` in queue order are considered in a step (FCFS queue
  order is slack order when SLOs are uniform; it bounds the per-step cost under overload), only while
  fewer than ``max_num_seqs`` requests would run, and only while the KV cache can hold each one's whole
  sequence (the engine's admission gate; the first that cannot stops admissions, as in vLLM).

Prefill admission budget (seed 003, section 4 and appendix A), computed every step over the running
decodes and all prefills ``D u P`` with global targets TTFT and TPOT:

    N_steps = (TTFT - min_i s_i) / TPOT + 1                      (steps the most urgent request needs)
    PAB = [TTFT - N_steps * a - sum_{s_i < TTFT} ((TTFT - s_i) / TPOT) * (b + d + c * L_i)] / (b + c)
          - sum_{i in P} remaining_prompt_i

Within a new request's TTFT window each existing request i must sample ``(TTFT - s_i) / TPOT`` tokens,
each costing ``b + c * L_i`` (plus the engine loop's ``d``, 0 in the paper); the window also pays ``a``
per step; what is left, at ``b + c`` per prefill token, is the prefill capacity, minus prefill already
queued. ``N_steps`` is at least 1 (the new request's
own step). On an empty unit ``PAB = (TTFT - a) / (b + c)``. Between steps the exported budget is
decremented by every prompt the unit accepted (the paper's coordinator does the same in its local view),
and reset to the empty-unit value when the unit runs dry. ``fairbatching+pab`` refuses a request whose
prompt exceeds the budget; the node counts it as rejected.
"""

from __future__ import annotations

import math
from collections import deque
from typing import ClassVar

from policies._compiled import mypyc_attr
from policies.base import BatchPolicy
from policies.batch.common import mode_of
from policies.cost.step_model import StepCoefficients
from policies.params import MAX_REQUESTS, MAX_SLO_MS, MAX_STEP_TOKENS, ParamSpec
from policies.types import ReasonValue, ScheduledTokens, StepFeedback, StepPlan, UnitView


@mypyc_attr(allow_interpreted_subclasses=True)  # plugins subclass shipped policies
class FairBatching(BatchPolicy):
    """Slack-envelope batching with an adaptive time budget and a prefill admission budget."""

    name: ClassVar[str] = "fairbatching"
    summary: ClassVar[str] = "FairBatching: slack envelopes, adaptive time budget, urgent decodes first (seed 003)"
    params_schema: ClassVar[tuple[ParamSpec, ...]] = (
        ParamSpec(
            "token_budget", "int", 0, "hard cap of tokens per step; 0 = the unit's max_num_batched_tokens",
            unit="tokens", min=0, max=MAX_STEP_TOKENS,
        ),
        ParamSpec(
            "pab_ttft_ms", "float", 0.0,
            "TTFT target of the admission budget; 0 = the smallest TTFT SLO among active requests",
            unit="ms", min=0.0, max=MAX_SLO_MS,
        ),
        ParamSpec(
            "pab_tpot_ms", "float", 0.0,
            "TPOT target of the admission budget; 0 = the smallest TPOT SLO among active requests",
            unit="ms", min=0.0, max=MAX_SLO_MS,
        ),
        ParamSpec(
            "anchor", "str", "first_token",
            "where token deadlines start: first_token (the paper's envelope t + TTFT + TPOT*j, and never later than "
            "first token + TPOT*j, which the paper's worst per-token TPOT needs) or arrival (the envelope alone)",
            choices=("arrival", "first_token"),
        ),
        ParamSpec(
            "waiting_scan", "int", 512, "waiting requests considered per step, in queue order",
            unit="requests", min=1, max=MAX_REQUESTS,
        ),
        ParamSpec(
            "margin_floor", "float", 0.005,
            "smallest relative margin while margin_quantile is on (a guard band for errors the window has not seen)",
            min=0.0, max=0.5,
        ),
        ParamSpec(
            "margin_quantile", "float", 0.99,
            "plan each step to end early by this quantile of the recent relative prediction errors "
            "(measured / predicted - 1, last 256 steps; 1 = the largest); 0 = plan to the deadline itself (the paper)",
            min=0.0, max=1.0,
        ),
    )
    refuses_over_budget: ClassVar[bool] = False
    margin_window: ClassVar[int] = 256
    """Steps whose prediction errors the margin is taken from."""
    margin_refresh: ClassVar[int] = 16
    """Steps between two recomputations of the margin (a sort of ``margin_window`` floats)."""
    margin_max: ClassVar[float] = 0.5
    """Largest relative margin (a step planned to at least 2/3 of its deadline), whatever the errors."""

    def configure(self) -> None:
        self.token_cap = int(self.params["token_budget"])
        self.pab_ttft_s = float(self.params["pab_ttft_ms"]) / 1e3
        self.pab_tpot_s = float(self.params["pab_tpot_ms"]) / 1e3
        self.waiting_scan = int(self.params["waiting_scan"])
        self.first_token_anchor = self.params["anchor"] == "first_token"
        self.margin_quantile = float(self.params["margin_quantile"])
        self.margin_floor = float(self.params["margin_floor"])
        if not hasattr(self, "_pab"):
            self._errors: deque[float] = deque(maxlen=self.margin_window)
            self._since_margin = 0
            self._pab: float | None = None
            self._accepted = 0
            self._empty_pab: float | None = None
            self._last_ttft_s = self.pab_ttft_s or 0.5
            self._last_tpot_s = self.pab_tpot_s or 0.05
            self._last_cost: StepCoefficients | None = None
        self._margin_rel = self._error_quantile()

    # -- admission budget ------------------------------------------------------------------------------
    def admission_budget_tokens(self) -> float | None:
        if self._pab is None:
            return None if self._empty_pab is None else self._empty_pab - self._accepted
        return self._pab - self._accepted

    def refuses(self, prompt_tokens: int, cost: StepCoefficients) -> bool:
        if self._pab is None:
            # No step since the unit was last empty: the empty-unit budget (TTFT - a) / (b + c).
            self._empty_pab = self._empty_budget(cost)
        if self.refuses_within(prompt_tokens, self.admission_budget_tokens()):
            return True
        self._accepted += prompt_tokens
        return False

    def refuses_within(self, prompt_tokens: int, budget_tokens: float | None) -> bool:
        return self.refuses_over_budget and budget_tokens is not None and prompt_tokens > budget_tokens

    def _empty_budget(self, cost: StepCoefficients) -> float:
        return (self._last_ttft_s - cost.a_s) / max(cost.b_s + cost.c_s, 1e-12)

    def observe_step(self, feedback: StepFeedback) -> None:
        cost = self._last_cost
        if cost is not None and feedback.measured_s > 0.0:
            # The error of the prediction this policy planned with (the coefficients of the plan, the loop term
            # included), not the unit's ``predicted_s``, which may leave the loop term out.
            new_tokens = feedback.num_prefill_tokens + feedback.num_decode_tokens  # not the property: Python
            predicted = cost.predict_s(new_tokens, feedback.context_tokens, feedback.num_requests)
            if predicted > 0.0:
                self._errors.append(feedback.measured_s / predicted - 1.0)
                self._since_margin += 1
                # Every step while the window is short (a new or hot-swapped policy has no errors yet, and its first
                # steps would be planned to the deadline itself), then every ``margin_refresh`` steps.
                if self._since_margin >= self.margin_refresh or len(self._errors) < self.margin_refresh:
                    self._margin_rel = self._error_quantile()
        if feedback.num_unfinished == 0:
            self._pab = None
            self._accepted = 0
            self._empty_pab = self._empty_budget(self._last_cost) if self._last_cost is not None else None

    def _error_quantile(self) -> float:
        """The ``margin_quantile`` of the recent relative errors, within ``[0, margin_max]`` (0 when off)."""
        self._since_margin = 0
        errors = self._errors
        if self.margin_quantile <= 0.0:
            return 0.0
        if not errors:
            return self.margin_floor
        q = sorted(errors)[min(len(errors) - 1, int(self.margin_quantile * len(errors)))]
        return min(max(q, self.margin_floor), self.margin_max)

    # -- the step --------------------------------------------------------------------------------------
    def plan(self, unit: UnitView, now_s: float) -> StepPlan:
        # The per-step hot path (hundreds of requests): plain loops over locals, no per-request helpers.
        cost = unit.cost
        self._last_cost = cost
        a, b, c, d = cost.a_s, cost.b_s, cost.c_s, cost.d_s
        bc = max(b + c, 1e-12)
        bcd = bc + d  # a decode: b + c * (k + 1) + d = bcd + c * k
        cap = unit.max_num_batched_tokens
        if self.token_cap:
            cap = min(cap, self.token_cap)
        max_len = unit.max_model_len
        running = unit.running
        num_running = len(running)
        reqs = list(running)
        reqs.extend(unit.waiting[: self.waiting_scan])
        n_all = len(reqs)

        seq_room = unit.max_num_seqs - num_running
        # Pass 1: slack, decode state, minima. Decodes (running only) and prefills by index.
        slacks = [0.0] * n_all
        decode_idx: list[int] = []
        prefill_idx: list[int] = []
        min_slack = min_tpot = min_ttft = math.inf
        anchor_first = self.first_token_anchor
        # PAB sums, accumulated in the same pass for a guessed TTFT target (redone if the guess was wrong).
        pab_ttft = self.pab_ttft_s or (reqs[0].ttft_slo_s if reqs else self._last_ttft_s)
        work = 0.0  # sum over s_i < TTFT of (TTFT - s_i) * (b + c * L_i)
        pending = 0
        decode_ctx = 0  # computed tokens over all running decodes
        for i in range(n_all):
            # One unpacking instead of nine field reads (RequestView's fields in order: policies/types.py).
            _, arrival, prompt, computed, out, ttft, tpot, first, _ = reqs[i]
            s = arrival + ttft + tpot * out - now_s
            if anchor_first and first is not None:
                s2 = first + tpot * out - now_s
                if s2 < s:
                    s = s2
            slacks[i] = s
            num_tokens = prompt + out
            pending += num_tokens - computed
            if s < pab_ttft:
                work += (pab_ttft - s) * (b + d + c * num_tokens)
            if s < min_slack:
                min_slack = s
            if tpot < min_tpot:
                min_tpot = tpot
            if ttft < min_ttft:
                min_ttft = ttft
            if i < num_running and out > 0 and num_tokens - computed == 1:
                decode_idx.append(i)
                decode_ctx += computed
            elif i < num_running or seq_room > 0:  # with no free slot a waiting request is never planned (2)
                prefill_idx.append(i)
        init = max(min_slack, min_tpot)
        threshold = init + min_tpot
        urgent = [i for i in decode_idx if slacks[i] < threshold]
        relaxed = [i for i in decode_idx if slacks[i] >= threshold] if len(urgent) < len(decode_idx) else []
        key = slacks.__getitem__
        urgent.sort(key=key)
        prefill_idx.sort(key=key)

        new = tuple.__new__
        # The step must end by ``init``; it is planned to end ``margin`` earlier (the measured prediction error).
        margin = init * self._margin_rel / (1.0 + self._margin_rel) if self._margin_rel and reqs else 0.0
        time_budget = init - margin - a
        token_budget = cap
        running_entries: list[ScheduledTokens] = []
        waiting_entries: list[ScheduledTokens] = []
        running_order: list[str] = []
        urgent_over_budget = urgent_taken = urgent_ctx = 0
        # (1) Urgent decodes: always taken (the token cap permitting), even past the time budget.
        for i in urgent:
            r = reqs[i]
            rid = r.request_id
            running_order.append(rid)
            if token_budget <= 0:
                continue
            k = r.computed_tokens
            urgent_ctx += k
            t = bcd + c * k
            if t > time_budget:
                urgent_over_budget += 1
            running_entries.append(new(ScheduledTokens, (rid, 1)))
            time_budget -= t
            token_budget -= 1
            urgent_taken += 1
        # (2) Prefills, whole or chunked to the time left.
        prefill_chunks = prefill_tokens = largest_chunk = admitted = 0
        chunk_limit = "none"
        bs = unit.block_size
        # KV left for admissions: free blocks minus what the urgent decodes' new tokens take.
        free_blocks = unit.free_blocks - sum(1 for i in urgent if reqs[i].computed_tokens % bs == 0)
        admit_blocked = False
        for i in prefill_idx:
            r = reqs[i]
            waiting = i >= num_running
            if not waiting:
                running_order.append(r.request_id)
            if token_budget <= 0 or time_budget <= 0 or (waiting and (admitted >= seq_room or admit_blocked)):
                continue
            k = r.computed_tokens
            if waiting:
                # The engine admits a request only if its whole sequence fits the KV cache, and stops admitting
                # at the first that does not (vLLM's waiting loop). Planning it anyway would leave its time
                # budget unused and, with the decodes held back for it, could leave the step empty.
                whole = -(-(r.prompt_tokens + r.output_tokens) // bs)
                if whole > free_blocks:
                    admit_blocked = True
                    continue
                free_blocks -= whole
            full = min(r.prompt_tokens + r.output_tokens - k, max_len - 1 - k)
            if full <= 0:
                continue
            fixed = c * k + d  # its context and its engine-loop share, whatever the chunk
            if full <= token_budget and bc * full + fixed <= time_budget:
                n = full
            elif fixed <= time_budget:
                by_time = int((time_budget - fixed) // bc)
                n = min(token_budget, by_time, full)
                chunk_limit = "tokens" if token_budget <= by_time else "time"
            else:
                n = 0
            if n <= 0:
                continue
            (waiting_entries if waiting else running_entries).append(new(ScheduledTokens, (r.request_id, n)))
            time_budget -= bc * n + fixed
            token_budget -= n
            prefill_chunks += 1
            prefill_tokens += n
            if n > largest_chunk:
                largest_chunk = n
            if waiting:
                admitted += 1
        # (3) The other decodes while time is left; those that do not fit are held back. When they all fit
        # (the common case) their order does not matter and the sort is skipped.
        held = relaxed_taken = 0
        held_min_slack = math.inf
        fits = False
        if relaxed:
            # Their context is what the urgent ones do not hold (urgent decodes past the token cap excepted:
            # then the exact sum is taken).
            relaxed_ctx = decode_ctx - urgent_ctx
            if urgent_taken < len(urgent):
                relaxed_ctx = sum(reqs[i].computed_tokens for i in relaxed)
            total = bcd * len(relaxed) + c * relaxed_ctx
            fits = total <= time_budget and len(relaxed) <= token_budget
        if relaxed and fits:
            ids = [reqs[i].request_id for i in relaxed]
            running_order.extend(ids)
            running_entries.extend([new(ScheduledTokens, (rid, 1)) for rid in ids])
            time_budget -= total
            token_budget -= len(ids)
            relaxed_taken = len(ids)
        elif relaxed:
            relaxed.sort(key=key)
            for i in relaxed:
                r = reqs[i]
                rid = r.request_id
                running_order.append(rid)
                t = bcd + c * r.computed_tokens
                if token_budget >= 1 and t <= time_budget:
                    running_entries.append(new(ScheduledTokens, (rid, 1)))
                    time_budget -= t
                    token_budget -= 1
                    relaxed_taken += 1
                else:
                    held += 1
                    if slacks[i] < held_min_slack:
                        held_min_slack = slacks[i]

        running_entries.extend(waiting_entries)
        decodes = urgent_taken + relaxed_taken
        ttft = self.pab_ttft_s or (min_ttft if min_ttft != math.inf else self._last_ttft_s)
        if ttft != pab_ttft:
            work = sum(
                (ttft - slacks[i]) * (b + d + c * (r.prompt_tokens + r.output_tokens))
                for i, r in enumerate(reqs) if slacks[i] < ttft
            )
        pab = self._update_pab(ttft, work, pending - len(decode_idx), min_slack, min_tpot, a, b, c, bool(reqs))
        reasons: dict[str, ReasonValue] = {
            "time_budget_ms": round((init - a) * 1e3, 3),
            "margin_ms": round(margin * 1e3, 3),
            "min_slack_ms": round(min_slack * 1e3, 3),
            "urgent_decodes": len(urgent),
            "urgent_over_budget": urgent_over_budget,
            "prefill_chunks": prefill_chunks,
            "prefill_tokens": prefill_tokens,
            "largest_chunk_tokens": largest_chunk,
            "chunk_limited_by": chunk_limit,
            "admitted": admitted,
            "admission_blocked_by_kv": admit_blocked,
            "urgent_decodes_taken": urgent_taken,
            "decodes_taken": decodes,
            "decodes_held_back": held,
            "predicted_step_ms": round((init - margin - time_budget) * 1e3, 3) if reqs else 0.0,  # (inf - inf)
            "loop_ms": round(d * (len(running_entries)) * 1e3, 3),
            "pab_tokens": round(pab, 1),
        }
        if held:
            reasons["held_back_min_slack_ms"] = round(held_min_slack * 1e3, 3)
        return StepPlan(  # positional: entries, running_order, mode, token_budget, reasons (a Python
            # __init__: keywords cost ~175 ns more per step)
            tuple(running_entries), tuple(running_order),
            mode_of(decodes > 0, prefill_chunks > 0), cap, reasons,
        )

    def _update_pab(
        self, ttft: float, work: float, queued: int, min_slack: float, min_tpot: float, a: float, b: float,
        c: float, busy: bool,
    ) -> float:
        """Store and return ``PAB = [TTFT - N_steps*a - work/TPOT] / (b + c) - queued`` (module docstring);
        ``work`` = sum over requests with ``s_i < TTFT`` of ``(TTFT - s_i) * (b + c*L_i)``, ``queued`` = the
        prefill tokens still to compute."""
        tpot = self.pab_tpot_s or (min_tpot if min_tpot != math.inf else self._last_tpot_s)
        self._last_ttft_s, self._last_tpot_s = ttft, tpot
        bc = max(b + c, 1e-12)
        n_steps = max((ttft - min_slack) / tpot + 1.0, 1.0) if busy else 1.0
        pab = (ttft - n_steps * a - work / tpot) / bc - queued
        self._pab = pab
        self._accepted = 0
        self._empty_pab = None
        return pab


@mypyc_attr(allow_interpreted_subclasses=True)  # plugins subclass shipped policies
class FairBatchingPab(FairBatching):
    """FairBatching that refuses requests whose prompt exceeds the prefill admission budget."""

    name: ClassVar[str] = "fairbatching+pab"
    summary: ClassVar[str] = "FairBatching with admission control: refuse prompts above the admission budget"
    refuses_over_budget: ClassVar[bool] = True

