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
    assert all(len(seen) > 1 for seen in behind.values()), rounds


def test_balanced_orders_put_every_key_everywhere_and_behind_every_other_key_once():
    """A Williams design: over n rounds (2n for odd n) each key takes each position equally often
    and follows each other key equally often."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _common as C
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    for n in range(1, 10):
        span = n if n % 2 == 0 else 2 * n
        rows = C.balanced_orders(n, span)
        times = span // n
        assert all(sorted(row) == list(range(n)) for row in rows)
        for pos in range(n):
            assert sorted(row[pos] for row in rows) == sorted(list(range(n)) * times)
        pairs = [(row[i - 1], row[i]) for row in rows for i in range(1, n)]
        want = sorted((a, b) for a in range(n) for b in range(n) if a != b) * times
        assert sorted(pairs) == sorted(want), (n, rows)
    assert C.balanced_orders(4, 6)[4:] == C.balanced_orders(4, 2)  # more rounds repeat the rows


def test_paired_ratio_is_the_median_over_rounds_of_the_rounds_median_ratios():
    """Round by round, the ratio of the two medians; then their median over the rounds. A clock
    that differs between rounds (here 1.3x in two of four) scales both medians of its round and
    leaves the ratios; a key that lost calls has no paired ratio."""
    import statistics

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _common as C
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    sizes = C.round_sizes(10, 4)
    assert sizes == [3, 3, 2, 2]
    clock = [1.0, 1.3, 1.3, 1.0]
    ref = [10.0 * clock[i] * (1 + 0.01 * j) for i, n in enumerate(sizes) for j in range(n)]
    times = [0.95 * t for t in ref]
    assert abs(C.paired_ratio(times, ref, sizes) - 0.95) < 1e-12
    # Per-round noise of the method: the ratios 0.95 * (1.02, 0.99, 1.04, 0.97), their median.
    wobble = [1.02, 0.99, 1.04, 0.97]
    noisy = [t * wobble[i] for i, n in enumerate(sizes) for t in times[sum(sizes[:i]):sum(sizes[:i]) + n]]
    want = statistics.median(0.95 * w for w in wobble)
    assert abs(C.paired_ratio(noisy, ref, sizes) - want) < 1e-12
    assert C.paired_ratio(times[:-1], ref, sizes) is None
    assert C.paired_ratio(times, ref[:-1], sizes) is None


def test_reports_give_each_upstream_variant_over_its_plain_mean_paired():
    """The loss report states `ours:x/masked` over `ours:x` per round (criterion: Megatron's mask
    within 5 % of the mean), from the stored call times, so that older JSONs render it too."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_loss as B
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    mean = [10.0, 10.0, 11.0, 20.0, 20.0, 22.0]  # 2 rounds of 3 calls: a slower second round
    masked = [10.5, 10.5, 10.0, 21.0, 21.0, 25.0]
    meta = {"repeats": 6, "rounds": 2}
    cs = {"methods": {
        "compile": {"fwd_bwd": {"times_ms": mean}},
        "ours:x": {"fwd_bwd": {"times_ms": mean}},
        "ours:x/masked": {"fwd_bwd": {"times_ms": masked}},
        "ours:y/masked": {"fwd_bwd": {"times_ms": masked}},  # no plain ours:y: nothing to pair with
        "ours:x/weighted": {"fwd_bwd": {"times_ms": masked[:-1]}},  # a call short: no paired ratio
    }}
    assert B.over_base_paired(cs, meta) == [("ours:x/masked", "ours:x", 1.05)]
