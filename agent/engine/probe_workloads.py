"""The workloads of the H100 calibration probe (``shared/gpu/probe.py``), regenerated exactly.

The probe drew every length (and every prompt token) from one ``random.Random(0)`` in a fixed order, so
replaying the same draws gives the very requests it measured. That lets the simulator be checked end to end
against measured throughput: same requests, same engine limits, step times from the profile.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

PROBE_TOKEN_LOW, PROBE_TOKEN_HIGH = 1000, 120000


@dataclass(frozen=True, slots=True)
class ProbeWorkload:
    tag: str
    requests: tuple[tuple[int, int], ...]
    """(prompt tokens, output tokens), all submitted at once."""

    @property
    def in_tokens(self) -> int:
        return sum(p for p, _ in self.requests)

    @property
    def out_tokens(self) -> int:
        return sum(o for _, o in self.requests)


def probe_workloads() -> list[ProbeWorkload]:
    """The six workloads in probe order: warmup, mix, longctx, small, dec128, sharegpt_like."""
    rng = random.Random(0)
    out: list[ProbeWorkload] = []

    def run(tag: str, reqs: list[tuple[int, int]]) -> None:
        # The probe drew one random token id per prompt token when it submitted the requests.
        for p, _ in reqs:
            for _ in range(p):
                rng.randrange(PROBE_TOKEN_LOW, PROBE_TOKEN_HIGH)
        out.append(ProbeWorkload(tag, tuple(reqs)))

    def lognorm(mu: float, sigma: float, lo: int, hi: int) -> int:
        return int(min(hi, max(lo, rng.lognormvariate(mu, sigma))))

    run("warmup", [(128, 16)] * 8)
    run("mix", [(rng.randint(16, 4096), rng.randint(16, 512)) for _ in range(400)])
    run("longctx", [(8000, 150)] * 48)
    run("small", [(100, 300)] * 4)
    run("dec128", [(rng.randint(200, 2000), 200) for _ in range(128)])
    out.append(
        ProbeWorkload(
            "sharegpt_like",
            tuple((lognorm(5.2, 1.0, 4, 4096), lognorm(5.2, 0.9, 4, 2048)) for _ in range(1000)),
        )
    )
    return out
