"""benchmarks/_common.time_in_rounds: every key gets its timed calls, and the order changes."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_rounds_shuffle_the_order_and_time_every_key():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _common as C
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    order = []
    keys = "abcdef"
    calls = [(key, lambda key=key: order.append(key)) for key in keys]
    out = C.time_in_rounds(calls, device="cpu", warmup=1, repeats=12, rounds=4)
    assert {key: len(times) for key, (times, failed) in out.items()} == {key: 12 for key in keys}
    assert all(failed is None for _, failed in out.values())
    # Each round: one warm-up and three timed calls per key, key after key.
    assert len(order) == 4 * 6 * 4
    rounds = [order[i * 24:(i + 1) * 24:4] for i in range(4)]
    assert all(sorted(r) == list(keys) for r in rounds)
    # No key always runs behind the same neighbour (a rotation of the list did that).
    behind = {key: {r[r.index(key) - 1] for r in rounds if r.index(key) > 0} for key in keys}
    assert any(len(seen) > 1 for seen in behind.values()), rounds
