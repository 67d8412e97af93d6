"""In-process tier: ``auto``'s watch after its race (collectives.api._Trial), on made-up times.

A trial's decisions come from figures that every rank holds alike (its rounds' block times,
the slowest rank's, agreed by one allreduce a round); here they are set by hand, so the
schedule of watch rounds and the switches can be checked exactly: how many calls of the pick
run between rounds (from each algorithm's cost over the pick), when a faster algorithm takes
over, and that a tie or one faster round does not switch.
"""
import math

import pytest

from collectives import api


class _Ctx:
    """What a trial reads of a communicator's context when no message moves."""

    def __init__(self):
        self.auto_last = (None,) * 8
        self.auto_trials = {}


def decided(times, lengths=10, names=("ring", "tree", "native")):
    """A trial whose race measured ``times`` (seconds a call, every round alike)."""
    trial = api._Trial(_Ctx(), "allreduce", 1 << 20, names)
    trial._lengths = [lengths] * len(names)
    trial.blocks = [[t] * api._Trial.MIN_ROUNDS for t in times]
    assert trial._decide()
    return trial


def run_pick(trial) -> int:
    """The calls of the pick until the next watch round begins."""
    calls = 0
    while trial.tick():
        calls += 1
    return calls


def watch(trial, pick_s, other_s) -> str:
    """One watch round in which the pick ran at ``pick_s`` a call and the other at
    ``other_s``; returns the pick after it."""
    name, _ = trial.next(blocking=True)
    assert trial.watching and name in (trial.decided[0], trial.names[trial._next])
    trial._round[trial._pick], trial._round[trial._next] = pick_s, other_s
    trial._watched()
    assert not trial.watching
    return trial.decided[0]


def test_watch_rounds_take_a_bounded_share_of_the_time():
    # ring the pick at 100 us; tree 2x slower (10-call blocks: 1 ms over the pick's), native
    # 1.01x (about as fast: its rounds cost mostly their barriers)
    trial = decided([100e-6, 200e-6, 101e-6])
    assert trial.decided[0] == "ring"
    share, least = api._Trial.WATCH_SHARE, api._Trial.WATCH_MIN_S
    over = api._Trial.WATCH_OVERHEAD_S
    assert trial._gap(1) == pytest.approx(2 * (10 * 100e-6 * 1.0 + over) / share)
    assert trial._gap(2) == pytest.approx(2 * (10 * 100e-6 * 0.01 + over) / share)
    rounds = {"tree": 0, "native": 0}
    calls, gaps = 0, []
    for _ in range(60):
        gaps.append(run_pick(trial))
        calls += gaps[-1]
        other = trial.names[trial._next]
        rounds[other] += 1
        assert watch(trial, 100e-6, 200e-6 if other == "tree" else 101e-6) == "ring"
    seconds = calls * 100e-6
    assert min(gaps) >= least / 100e-6  # WATCH_MIN_S of the pick's calls between rounds
    # each algorithm as often as its cost allows: the rounds' cost over the pick's, barriers
    # counted, is WATCH_SHARE of the time
    # (a round waits for the one before by WATCH_MIN_S at most)
    assert seconds / (trial._gap(1) + least) - 1 <= rounds["tree"] <= seconds / trial._gap(1) + 1
    assert rounds["native"] + rounds["tree"] == 60 and rounds["native"] >= 45
    extra = rounds["tree"] * (1e-3 + over) + rounds["native"] * (10e-6 + over)
    assert extra <= share * seconds * 1.1


def test_a_faster_algorithm_takes_over_after_five_rounds():
    trial = decided([100e-6, 130e-6, 300e-6])
    seen = []
    for _ in range(40):
        run_pick(trial)
        other = trial.names[trial._next]
        # tree now runs 25% faster than ring; native stays slow
        seen.append((other, watch(trial, 100e-6, 75e-6 if other == "tree" else 300e-6)))
        if trial.switches:
            break
    tree_rounds = [pick for other, pick in seen if other == "tree"]
    assert tree_rounds == ["ring"] * 4 + ["tree"], seen
    assert trial.decided[0] == "tree" and trial._pick == 1 and trial.switches == 1
    # the others' ratios are now to tree's time: ring 1/0.75 of it
    assert trial._ratio[0] == pytest.approx(1 / 0.75)
    assert trial._due[1] == math.inf


def test_a_tie_or_one_fast_round_does_not_switch():
    trial = decided([100e-6, 100e-6], names=("ring", "tree"))
    pattern = [90e-6, 110e-6, 90e-6, 90e-6, 110e-6, 100e-6, 90e-6, 105e-6] * 4
    for t in pattern:
        run_pick(trial)
        assert watch(trial, 100e-6, t) == "ring"
    assert trial.switches == 0


def test_no_watch_with_a_zero_share(monkeypatch):
    monkeypatch.setattr(api._Trial, "WATCH_SHARE", 0.0)
    trial = decided([100e-6, 100e-6], names=("ring", "tree"))
    assert all(trial.tick() for _ in range(100000))
    assert not trial.watching
