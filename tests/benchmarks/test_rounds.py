"""benchmarks/_common.time_in_rounds: every key gets its timed calls, and the order rotates."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_rounds_rotate_the_order_and_time_every_key():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _common as C
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    order = []
    calls = [(key, lambda key=key: order.append(key)) for key in "abc"]
    out = C.time_in_rounds(calls, device="cpu", warmup=1, repeats=6, rounds=3)
    assert {key: len(times) for key, (times, failed) in out.items()} == {"a": 6, "b": 6, "c": 6}
    assert all(failed is None for _, failed in out.values())
    # Each round: one warm-up and two timed calls per key, starting one key further down.
    firsts = [order[i * 9] for i in range(3)]
    assert firsts == ["a", "b", "c"] and len(order) == 27
