"""Wire cost of step events: encode and decode rates and bytes per event, MessagePack and JSON.

    python tests/benchmarks/bench_protocol.py [--events 200000] [--repeat 5]

Builds ``--events`` step events the way the agent will (``agent.runtime.events.step_event`` from a ``StepRecord``
carrying fairbatching's 16 reasons), then times, with ``time.perf_counter_ns``, encoding them all, decoding
them all (typed, into ``Event``), the same as batch frames of 512 events (``Codec.encode_batch``,
``decode_agent_frame``), and the agent's per-event path before encoding (sequence stamp, ring append, offer
to one subscriber). Results are discarded as they come, as a sender or a folding reader
does (keeping 200,000 decoded events alive makes the collector scan them and roughly doubles the decode
time). Best of ``--repeat`` rounds. Prints numbers, asserts nothing.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable

import msgspec

from agent.engine.base import StepRecord
from agent.runtime.events import NodeOrigin, step_event
from agent.telemetry import CODECS, StepEvent
from agent.telemetry.stream import ReplayBuffer, Sequencer, Subscription
from policies.types import ReasonValue, StepMode

REASONS: dict[str, ReasonValue] = {
    "time_budget_ms": 42.125, "min_slack_ms": 12.5, "urgent_decodes": 3, "urgent_over_budget": False,
    "prefill_chunks": 2, "prefill_tokens": 1536, "largest_chunk_tokens": 1024, "chunk_limited_by": "time",
    "admitted": 1, "admission_blocked_by_kv": False, "urgent_decodes_taken": 3, "decodes_taken": 187,
    "decodes_held_back": 12, "predicted_step_ms": 28.375, "pab_tokens": 20480.5, "held_back_min_slack_ms": 31.0,
}
BATCH = 512
"""Events per batch frame (what ``agent.telemetry.client`` asks for); per-event figures are per event in the batches."""


def records(n: int) -> list[StepRecord]:
    return [
        StepRecord(
            unit_id=i % 8, step_id=i // 8, start_s=i * 0.003, duration_s=0.0281 + (i % 7) * 1e-4,
            predicted_s=0.0284, mode=StepMode.MIXED, policy="fairbatching", num_prefill_tokens=1536,
            num_decode_tokens=190, num_prefill_reqs=2, num_decode_reqs=190, context_tokens=380_000 + i % 1000,
            budget_tokens=2048, kv_used_blocks=24_000 + i % 500, num_blocks=32_768, num_running=192, num_waiting=7,
            num_preempted=0, num_finished=i % 3, reasons=REASONS,
        )
        for i in range(n)
    ]


def best_ns(fn: Callable[[], object], repeat: int) -> int:
    best = None
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        dt = time.perf_counter_ns() - t0
        best = dt if best is None else min(best, dt)
    assert best is not None
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    n = args.events
    origin = NodeOrigin("node-0", time.time_ns())
    recs = records(n)
    def convert() -> None:
        for r in recs:
            step_event(r, origin)

    convert_ns = best_ns(convert, args.repeat)
    seq = Sequencer()
    events: list[StepEvent] = [seq.stamp(step_event(r, origin)) for r in recs]

    def fan_out() -> None:
        s, ring, sub = Sequencer(), ReplayBuffer(65_536), Subscription("node-0", max_queued=4096)
        for e in events:
            e = s.stamp(e)
            ring.append(e)
            sub.offer(e)

    fan_ns = best_ns(fan_out, args.repeat)
    print(f"python {platform.python_version()} msgspec {msgspec.__version__} on {platform.machine()}, "
          f"{n} step events with {len(REASONS)} reasons, best of {args.repeat}")
    print(f"{'path':<28} {'ns/event':>9} {'events/s':>11} {'bytes/event':>12}")
    print(f"{'convert StepRecord':<28} {convert_ns / n:>9.0f} {n / convert_ns * 1e9:>11.0f} {'':>12}")
    print(f"{'stamp+ring+offer':<28} {fan_ns / n:>9.0f} {n / fan_ns * 1e9:>11.0f} {'':>12}")
    for fmt, codec in CODECS.items():
        frames = [codec.encode(e) for e in events]
        size = sum(map(len, frames)) / n
        encode, decode = codec.encode, codec.decode_event

        def encode_all(encode: Callable[[StepEvent], bytes] = encode) -> None:
            for e in events:
                encode(e)

        def decode_all(decode: Callable[[bytes], object] = decode, frames: list[bytes] = frames) -> None:
            for f in frames:
                decode(f)

        enc_ns = best_ns(encode_all, args.repeat)
        dec_ns = best_ns(decode_all, args.repeat)
        both = enc_ns + dec_ns
        print(f"{fmt + ' encode':<28} {enc_ns / n:>9.0f} {n / enc_ns * 1e9:>11.0f} {size:>12.0f}")
        print(f"{fmt + ' decode':<28} {dec_ns / n:>9.0f} {n / dec_ns * 1e9:>11.0f} {size:>12.0f}")
        print(f"{fmt + ' encode+decode':<28} {both / n:>9.0f} {n / both * 1e9:>11.0f} {size:>12.0f}")
        batches = [codec.encode_batch(events[i : i + BATCH])[0] for i in range(0, n, BATCH)]
        batch_size = sum(map(len, batches)) / n
        decode_frame = codec.decode_agent_frame

        def encode_batches(encode_batch: Callable[..., object] = codec.encode_batch) -> None:
            for i in range(0, n, BATCH):
                encode_batch(events[i : i + BATCH])

        def decode_batches(decode: Callable[[bytes], object] = decode_frame, frames: list[bytes] = batches) -> None:
            for f in frames:
                decode(f)

        enc_ns = best_ns(encode_batches, args.repeat)
        dec_ns = best_ns(decode_batches, args.repeat)
        label = f"{fmt} batch of {BATCH}"
        print(f"{label + ' encode':<28} {enc_ns / n:>9.0f} {n / enc_ns * 1e9:>11.0f} {batch_size:>12.0f}")
        print(f"{label + ' decode':<28} {dec_ns / n:>9.0f} {n / dec_ns * 1e9:>11.0f} {batch_size:>12.0f}")


if __name__ == "__main__":
    main()
