"""``bench ddp --link``'s breakdown of a step, on made-up link samples (in process)."""
import pytest

pytest.importorskip("torch")

from bench.ddp import link_breakdown  # noqa: E402


def test_link_breakdown_finds_the_busy_span_and_its_idle_slices():
    # one host, sampled every ms for 0.6 s: 100 MB/s sent from 0.1 to 0.5 s but for
    # 0.3-0.32 s, and 1 MB/s received throughout (below half the busiest rate)
    rows, sent, got = [], 0.0, 0.0
    for k in range(601):
        t = k / 1000
        rows.append((10 + t, int(sent), int(got)))
        busy = 0.1 <= t < 0.5 and not 0.3 <= t < 0.32
        sent += 1e5 if busy else 0
        got += 1e3
    marks = [(10.0, 10.05, 10.08, 10.52, 10.6)]
    got = link_breakdown(marks, [rows])
    assert got["forward"] == pytest.approx(50)
    assert got["first launch"] == pytest.approx(80)
    assert got["link busy from"] == pytest.approx(100)
    assert got["link busy to"] == pytest.approx(500)
    assert got["link idle inside"] == pytest.approx(20)
    assert got["reduced"] == pytest.approx(520)
    assert got["step"] == pytest.approx(600)
