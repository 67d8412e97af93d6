"""Pipeline schedules in one process: ``pp.verify`` over every (p, m, v), hand-broken schedules
rejected by name, ``pp.simulate`` against the closed forms of GPipe, 1F1B, interleaved 1F1B and
ZB-H1.
"""
import pytest

from collectives.torch.pipeline import simulate as sim_module  # noqa: F401 - imports alone
from collectives.torch.pipeline.schedules import (B, F, RECV_B, RECV_F, SEND_B, SEND_F, W,
                                                  Schedule, schedule)
from collectives.torch.pipeline.simulate import simulate
from collectives.torch.pipeline.verify import ScheduleError, verify

NAMES = ("gpipe", "1f1b", "interleaved", "zero_bubble")


def _defined(name):
    """Every (p, m, v) of the acceptance grid where ``name`` is defined."""
    for p in range(1, 17):
        for m in range(1, 33):
            for v in range(1, 5) if name == "interleaved" else (1,):
                if v > 1 and m % max(1, m // p):
                    continue
                yield p, m, v


@pytest.mark.parametrize("name", NAMES)
def test_every_schedule_verifies(name):
    count = 0
    for p, m, v in _defined(name):
        s = verify(schedule(name, p, m, v))
        compute = sum(len(s.compute(r)) for r in range(p))
        assert compute == m * p * v * (3 if s.split_backward else 2), (p, m, v)
        count += 1
    assert count >= 16 * 32


def test_undefined_parameters_are_refused():
    with pytest.raises(ValueError, match="multiple of the rounds"):
        schedule("interleaved", 4, 9, 2)        # rounds of 9 // 4 = 2 cannot split 9
    with pytest.raises(ValueError, match="virtual=1"):
        schedule("1f1b", 4, 8, 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        schedule("dualpipe", 4, 8)
    with pytest.raises(ValueError, match="positive integer"):
        schedule("gpipe", 0, 8)


def _lists(name, p, m, v=1):
    s = schedule(name, p, m, v)
    return [list(s.actions(r)) for r in range(p)], s.split_backward


def _broken(lists, split=False, name="broken", p=None, m=1, v=1):
    return Schedule(name, p or len(lists), m, v, lists, split_backward=split)


def test_crossing_receives_are_a_cycle_named_at_the_first_receive():
    # Rank 0 waits for the gradient before sending the activation that rank 1 waits for.
    lists, _ = _lists("gpipe", 2, 1)
    assert lists[0] == [(F, 0, 0), (SEND_F, 0, 0), (RECV_B, 0, 0), (B, 0, 0)]
    lists[0] = [(RECV_B, 0, 0), (F, 0, 0), (SEND_F, 0, 0), (B, 0, 0)]
    with pytest.raises(ScheduleError, match=r"rank 0 action 0 RECV_B\(0, 0\) can never run: a "
                                            r"cycle of waits") as err:
        verify(_broken(lists, p=2))
    assert (err.value.rank, err.value.index) == (0, 0)
    assert "rank 1 at action 0 RECV_F(0, 1) waits for rank 0's SEND_F(0, 0)" in str(err.value)


def test_a_forward_before_its_receive_is_named():
    lists, _ = _lists("1f1b", 3, 4)
    i = lists[1].index((RECV_F, 2, 1))
    lists[1][i], lists[1][i + 1] = lists[1][i + 1], lists[1][i]
    with pytest.raises(ScheduleError, match=rf"rank 1 action {i} F\(2, 1\) can never run: it "
                                            rf"needs the receive of F\(2, 1\)"):
        verify(_broken(lists, m=4))


def test_a_deadlock_three_ranks_long():
    # 1F1B with the last rank's first backward moved before its forward: it never runs.
    lists, _ = _lists("1f1b", 3, 2)
    i = lists[2].index((B, 0, 2))
    lists[2].insert(0, lists[2].pop(i))
    with pytest.raises(ScheduleError, match=r"rank 2 action 0 B\(0, 2\) can never run: it needs "
                                            r"F\(0, 2\)"):
        verify(_broken(lists, m=2))


def test_bookkeeping_faults():
    lists, split = _lists("zero_bubble", 2, 2)
    dropped = [a for a in lists[1] if a != (W, 1, 1)]
    with pytest.raises(ScheduleError, match=r"W\(1, 1\) is missing on rank 1"):
        verify(_broken([lists[0], dropped], split, m=2))
    twice = lists[0] + [(F, 0, 0)]
    with pytest.raises(ScheduleError, match=r"F\(0, 0\) is done twice on rank 0"):
        verify(_broken([twice, lists[1]], split, m=2))
    with pytest.raises(ScheduleError, match="W in a schedule whose B is the whole backward"):
        verify(_broken(lists, False, m=2))
    nosend = [a for a in lists[1] if a != (SEND_B, 0, 1)]
    with pytest.raises(ScheduleError, match=r"RECV_B\(0, 0\) can never run: no rank sends"):
        verify(_broken([lists[0], nosend], split, m=2))
    wrong = [(F, 0, 1)] + lists[0]
    with pytest.raises(ScheduleError, match="stage 1 is held by rank 1"):
        verify(_broken([wrong, lists[1]], split, m=2))


def test_no_messages_when_stages_share_a_rank():
    s = verify(schedule("interleaved", 1, 3, 4))
    assert all(a.kind in (F, B) for a in s.actions(0))
    # one micro-batch per round: depth first through the four chunks, then 1F1B
    assert s.actions(0)[:6] == [(F, 0, 0), (F, 0, 1), (F, 0, 2), (F, 0, 3), (B, 0, 3),
                                (F, 1, 0)]


# -- simulate ---------------------------------------------------------------------------------

def _idle(sim):
    """Bubble time per rank (every rank does the same work here)."""
    return sim.step - sim.busy[0]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_the_closed_form(name):
    for p in range(1, 9):
        for m in range(1, 17):
            sim = simulate(schedule(name, p, m), forward=1.0, backward=2.0)
            assert sim.step == pytest.approx(3.0 * (m + p - 1))
            assert sim.bubble == pytest.approx((p - 1) / (m + p - 1))


def test_peak_activations_on_the_first_stage():
    for p in range(1, 9):
        for m in range(1, 17):
            assert simulate(schedule("gpipe", p, m)).peak[0] == m
            one = simulate(schedule("1f1b", p, m)).peak
            assert one[0] == min(p, m)
            assert one == [min(p - r, m) for r in range(p)]
            assert max(simulate(schedule("zero_bubble", p, m)).peak) <= min(p, m)


def test_interleaving_divides_the_bubble_by_v():
    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 4 * p):
            one = _idle(simulate(schedule("1f1b", p, m), 1.0, 2.0))
            assert one == pytest.approx(3.0 * (p - 1))
            for v in (2, 3, 4):
                chunk = simulate(schedule("interleaved", p, m, v), 1.0 / v, 2.0 / v)
                assert chunk.busy[0] == pytest.approx(3.0 * m)
                assert _idle(chunk) == pytest.approx(one / v), (p, m, v)


def test_zero_bubble_h1_is_a_third_of_1f1b():
    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 3 * p + 1):
            one = simulate(schedule("1f1b", p, m), 1.0, 1.0, 1.0)
            zb = simulate(schedule("zero_bubble", p, m), 1.0, 1.0, 1.0)
            assert _idle(zb) == pytest.approx(_idle(one) / 3), (p, m)
            assert zb.bubble < 0.5 * one.bubble


def test_per_stage_times_and_messages():
    f, b = [1.0, 3.0, 2.0], [2.0, 1.0, 4.0]
    for m in (1, 2, 5):
        sim = simulate(schedule("gpipe", 3, m), forward=f, backward=b)
        # a flow shop of identical jobs: every stage once, then the slowest m - 1 more times
        assert sim.step == pytest.approx(sum(f) + (m - 1) * max(f) + sum(b) + (m - 1) * max(b))
    one = simulate(schedule("1f1b", 4, 1), 1.0, 2.0, p2p=0.25)
    assert one.step == pytest.approx(4 * 3.0 + 2 * 3 * 0.25)
    with pytest.raises(ValueError, match="one time per stage"):
        simulate(schedule("gpipe", 3, 2), forward=[1.0, 2.0])


def test_draw_has_a_line_per_rank():
    sim = simulate(schedule("zero_bubble", 4, 6), 1.0, 1.0, 1.0)
    lines = sim.draw().splitlines()
    assert len(lines) == 4
    assert lines[3].startswith("rank  3 |...FBFB")
