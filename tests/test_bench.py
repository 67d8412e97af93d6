"""The benchmark: harness pieces in process, and small real runs under mpiexec."""
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import harness, tune
from bench.allgather import Allgather
from bench.allreduce import Allreduce
from bench.reduce_scatter import ReduceScatter

ROOT = Path(__file__).resolve().parent.parent


def test_parse_size():
    assert harness.parse_size("8") == 8
    assert harness.parse_size("64K") == 64 << 10
    assert harness.parse_size("64M") == 64 << 20
    assert harness.parse_size("1G") == 1 << 30
    assert harness.parse_size("1KiB") == 1024
    assert harness.parse_size("256MB") == 256 << 20
    assert harness.parse_size("1.5K") == 1536
    assert harness.parse_size(12) == 12
    for bad in ("", "M", "12Q", "-1", "0.5"):
        with pytest.raises(ValueError):
            harness.parse_size(bad)


def test_parse_time_and_rate():
    assert harness.parse_time("5us") == pytest.approx(5e-6)
    assert harness.parse_time("1.5ms") == pytest.approx(1.5e-3)
    assert harness.parse_time("2e-6") == pytest.approx(2e-6)
    assert harness.parse_rate("25GB/s") == pytest.approx(25e9)
    assert harness.parse_rate("100Gb/s") == pytest.approx(12.5e9)
    assert harness.parse_rate("10GiB/s") == pytest.approx(10 * 2 ** 30)
    assert harness.parse_rate("800MB/s") == pytest.approx(8e8)
    with pytest.raises(ValueError):
        harness.parse_time("fast")
    for bad in ("25GB", "lots", "5us"):  # "25GB" without /s reads like a size: refused
        with pytest.raises(ValueError):
            harness.parse_rate(bad)


def test_format_size_and_sizes():
    assert [harness.format_size(n) for n in (8, 1024, 3 << 20, 1 << 30, 1536)] == \
        ["8", "1K", "3M", "1G", "1536"]
    assert harness.byte_sizes(8, 64, 2) == [8, 16, 32, 64]
    assert harness.byte_sizes(8, 100, 4) == [8, 32]
    assert harness.byte_sizes(1, 3, 1.5) == [1, 2, 3]
    with pytest.raises(ValueError):
        harness.byte_sizes(64, 8, 2)
    with pytest.raises(ValueError):
        harness.byte_sizes(8, 64, 1)


def test_busbw_factors():
    assert harness.busbw_factor("allreduce", 4) == 1.5
    assert harness.busbw_factor("allreduce", 1) == 0
    assert harness.busbw_factor("reduce_scatter", 4) == 0.75
    assert harness.busbw_factor("allgather", 2) == 0.5
    assert harness.busbw_factor("broadcast", 8) == 1
    assert harness.busbw_factor("reduce", 8) == 1
    with pytest.raises(ValueError, match="unknown collective"):
        harness.busbw_factor("alltoall", 2)


def test_counts_follow_nccl_tests():
    assert Allreduce().counts(10, 3) == (10, 10, 10)
    # reduce-scatter: the size column is the whole input; rank gets count // n
    assert ReduceScatter().counts(10, 3) == (9, 3, 9)
    # all-gather: the size column is the whole output
    assert Allgather().counts(10, 3) == (3, 9, 9)
    assert Allgather().counts(2, 3) == (1, 3, 3)


@pytest.mark.parametrize("op", ["sum", "avg", "prod", "min", "max"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "int32", "float64"])
def test_expected_reduce_is_exact(op, dtype):
    if op == "avg" and dtype == "int32":
        pytest.skip("avg is for floats")
    n, count = 5, 23
    got = harness.expected_reduce(n, count, dtype, op)
    data = np.stack([harness.rank_data(r, count, dtype, op).astype(np.float64)
                     for r in range(n)])
    ref = {"sum": data.sum(0), "avg": data.sum(0), "prod": data.prod(0), "min": data.min(0),
           "max": data.max(0)}[op]
    if op == "avg":
        ref = (ref.astype(dtype) / np.asarray(n, dtype)).astype(np.float64)
    assert got.dtype == np.dtype(dtype)
    assert (got.astype(np.float64) == ref).all()
    # rank-dependent: two ranks' data differ
    assert (harness.rank_data(0, count, dtype, op) != harness.rank_data(1, count, dtype, op)).any()


def _result(alg, mode, t, nbytes=1024, n=2, wrong=0, rounds=(1.0, 1.0, 1.0)):
    r = harness.Result("allreduce", nbytes, nbytes // 4, "float32", "sum", -1, alg, mode, n,
                       harness.busbw_factor("allreduce", n))
    r.rounds = [t * x for x in rounds]
    r.ranks_t = [[t * x * 0.9, t * x] for x in rounds]
    r.iters, r.wrong = 10, wrong
    return r


def test_drift_is_taken_out_of_every_algorithm():
    """The machine ran rounds 2-4 1.5x slower for everyone; ``auto`` (the same code as
    ``native``) was lucky in one slow round, so the plain medians differ by half; corrected,
    they agree. An erratic algorithm does not move the factors (a median over algorithms)."""
    machine = (1.0, 1.0, 1.5, 1.5, 1.5)
    native = _result("native", "out", 1e-5, rounds=machine)
    auto = _result("auto", "out", 1e-5, rounds=(1.0, 1.0, 1.0, 1.5, 1.5))
    ring = _result("ring", "out", 4e-5, rounds=machine)
    tree = _result("tree", "out", 3e-5, rounds=machine)
    odd = _result("shm", "out", 2e-5, rounds=(1.0, 3.0, 1.5, 0.5, 1.5))
    assert auto.time / native.time == pytest.approx(1 / 1.5)
    harness.correct_drift([native, auto, ring, tree, odd])
    assert native.drift == pytest.approx([1 / 1.5, 1 / 1.5, 1.0, 1.0, 1.0])
    assert native.time == pytest.approx(1.5e-5) and ring.time == pytest.approx(6e-5)
    assert auto.time == pytest.approx(native.time)
    assert native.to_dict()["drift"] == pytest.approx(native.drift)
    assert native.to_dict()["rounds_us"] == pytest.approx([m * 10 for m in machine])


def test_drift_needs_two_rounds_and_two_algorithms():
    one = _result("ring", "out", 1e-3, rounds=(1.0, 1.2, 0.9))
    harness.correct_drift([one])
    assert one.drift is None and one.time == pytest.approx(1e-3)
    x, y = _result("ring", "out", 1e-3, rounds=(1.0,)), _result("tree", "out", 2e-3, rounds=(1.5,))
    harness.correct_drift([x, y])
    assert x.drift is None and y.time == pytest.approx(3e-3)


def test_result_statistics():
    r = _result("ring", "out", 1e-3, rounds=(1.0, 1.2, 0.9))
    assert r.time == pytest.approx(1e-3)
    assert r.spread == pytest.approx(0.3)
    assert r.algbw == pytest.approx(1024 / 1e-3)
    assert r.busbw == pytest.approx(r.algbw * 1.0)  # 2(n-1)/n = 1 for n = 2
    lo, avg, hi = r.latency()
    assert (lo, hi) == (pytest.approx(0.9e-3), pytest.approx(1e-3))
    assert r.to_dict()["busbw_GBps"] == pytest.approx(r.busbw / 1e9)


def test_table_has_every_column_and_ratio_to_native():
    spec = Allreduce()
    res = [_result("native", "out", 2e-3), _result("native", "in", 2e-3),
           _result("ring", "out", 1e-3), _result("ring", "in", 4e-3, wrong=None),
           _result("gloo", "in", 8e-3)]
    text = harness.format_table(spec, res, latency=True, membw_Bps=1e9)
    head = text.splitlines()[:3]
    for col in ("size", "count", "type", "redop", "root", "algorithm", "time", "algbw",
                "busbw", "#wrong", "xnative", "%bound", "lat-min", "lat-avg", "lat-max"):
        assert col in head[1], col
    assert "out-of-place" in head[0] and "in-place" in head[0]
    rows = {ln.split()[5]: ln.split() for ln in text.splitlines()[3:]}
    assert set(rows) == {"native", "ring", "gloo"}
    assert rows["ring"][-2] == "2.00"          # twice as fast as native, out of place
    assert rows["native"][-2] == "1.00"
    assert "N/A" in rows["ring"]                # unchecked in place
    assert rows["gloo"][6] == "-"               # gloo has no out-of-place allreduce
    assert rows["gloo"][-2] == "0.25"           # its ratio comes from the in-place column
    # %bound: 2 n N bytes at 1 GB/s over the time
    assert float(rows["ring"][-1]) == pytest.approx(100 * 2 * 2 * 1024 / 1e9 / 1e-3, abs=0.1)
    foot = "\n".join(harness.footer(res, ["out", "in"]))
    assert "Avg bus bandwidth" in foot and "ring" in foot


def test_footer_says_what_auto_ran():
    res = []
    for nbytes, pick in ((8, "native"), (64, "native"), (512, "ring"), (4096, "shm")):
        r = _result("auto", "out", 1e-3)
        r.nbytes, r.picked = nbytes, pick
        res.append(r)
    foot = harness.footer(res, ["out"])
    assert foot[-1] == "# auto ran: native (8 - 64), ring (512), shm (4K)"
    assert res[0].to_dict()["picked"] == "native"
    inplace = []
    for r in res:
        q = _result("auto", "in", 1e-3)
        q.nbytes, q.picked = r.nbytes, "native" if r.nbytes < 4096 else "shm"
        inplace.append(q)
    foot = harness.footer(res + inplace, ["out", "in"])
    assert foot[-2:] == ["# auto ran: native (8 - 64), ring (512), shm (4K)",
                         "# auto ran in place: native (8 - 512), shm (4K)"]
    same = [_result("auto", "in", 1e-3) for _ in res]
    for q, r in zip(same, res):
        q.nbytes, q.picked = r.nbytes, r.picked
    assert "in place" not in "\n".join(harness.footer(res + same, ["out", "in"]))
    # a pick that a race again changed during a size's rounds: both, in order
    res[3].then = "tree"
    assert harness.footer(res, ["out"])[-1] == \
        "# auto ran: native (8 - 64), ring (512), shm, then tree (4K)"
    assert res[3].to_dict()["then"] == "tree" and res[0].to_dict()["then"] is None


def test_json_and_csv(tmp_path):
    res = [_result("native", "out", 2e-3), _result("ring", "out", 1e-3)]
    harness.write_json(tmp_path / "r.json", res, {"ranks": 2})
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["ranks"] == 2 and len(data["results"]) == 2
    harness.write_csv(tmp_path / "r.csv", res)
    lines = (tmp_path / "r.csv").read_text().splitlines()
    assert lines[0].startswith("collective,size,count") and len(lines) == 3


def test_verdict_counts_autos_misses(tmp_path, capsys):
    from bench import verdict
    res = [_result("native", "out", 2e-3), _result("ring", "out", 1e-3),
           _result("auto", "out", 1.06e-3),  # ring's code, 6% slower: a miss
           _result("native", "in", 2e-3), _result("ring", "in", 1e-3),
           _result("auto", "in", 0.98e-3), _result("gloo", "in", 0.5e-3)]  # gloo: not a row
    res[2].picked, res[5].picked = "ring", "native"
    harness.write_json(tmp_path / "r.json", res, {"ranks": 2})
    found = verdict.cells(json.loads((tmp_path / "r.json").read_text())["results"])
    assert [(c["mode"], c["best"], c["miss"]) for c in found] == \
        [("in", "ring", False), ("out", "ring", True)]
    assert found[1]["ratio"] == pytest.approx(1 / 1.06) and \
        found[1]["own"] == pytest.approx(1 / 1.06)
    assert found[0]["own"] == pytest.approx(2 / 0.98)  # auto ran native, the slower one
    assert verdict.main([str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "MISS" in out and "1 of 2 cells below 0.95 (n = 2: 1 of 2)" in out
    assert "own pick's row: 1" in out


def test_verdict_skips_the_tuning_table_beside_the_runs(tmp_path, capsys):
    """``make verify-auto`` writes tuning.json beside the runs' JSON: ``DIR/*.json`` works."""
    from bench import verdict
    res = [_result("native", "out", 2e-3), _result("auto", "out", 2e-3)]
    res[1].picked = "native"
    harness.write_json(tmp_path / "r.json", res, {"ranks": 2})
    (tmp_path / "tuning.json").write_text(json.dumps({"version": 1, "tables": {}}))
    assert verdict.main([str(tmp_path / "r.json"), str(tmp_path / "tuning.json")]) == 0
    captured = capsys.readouterr()
    assert "0 of 1 cells below 0.95" in captured.out
    assert "skipped" in captured.err and "tuning.json" in captured.err
    with pytest.raises(SystemExit, match="none of the files"):
        verdict.main([str(tmp_path / "tuning.json")])


def test_twin_rows_run_the_same_code_and_the_verdict_reports_the_floor(tmp_path, capsys):
    """``--twin`` adds ``NAME#2`` rows (not of auto or gloo), which run NAME's code; the
    verdict leaves them out of auto's best and reports the floor from them: two rows of one
    code apart, and an oracle (the best algorithm's code as a row of its own) against the best
    of the other rows."""
    from bench import verdict
    assert harness.twins(["native", "ring", "auto", "gloo"]) == \
        ["native", "ring", "auto", "gloo", "native#2", "ring#2"]
    assert harness.code("ring#2") == "ring" and harness.code("ring") == "ring"
    # out of place: ring the best in both rows, its twin 7% slower than its first row: the
    # oracle misses one way (ring#2 against ring, 0.935), not the other (ring against ring#2,
    # 1.07); in place: every pair within 2%
    res = [_result("native", "out", 2e-3), _result("ring", "out", 1e-3),
           _result("native#2", "out", 2e-3), _result("ring#2", "out", 1.07e-3),
           _result("auto", "out", 1.0e-3),
           _result("native", "in", 1.5e-3), _result("ring", "in", 1e-3),
           _result("native#2", "in", 1.52e-3), _result("ring#2", "in", 1.01e-3),
           _result("auto", "in", 1.0e-3)]
    res[4].picked = res[9].picked = "ring"
    harness.write_json(tmp_path / "r.json", res, {"ranks": 2})
    rows = json.loads((tmp_path / "r.json").read_text())["results"]
    found = verdict.cells(rows)
    assert [c["best"] for c in found] == ["ring", "ring"]  # not ring#2, a twin
    assert not any(c["miss"] for c in found)
    base = verdict.floor(rows)
    assert base["pairs"] == 4 and base["apart"] == 1
    assert [(o["cell"][2], o["ran"], round(o["ratio"], 3)) for o in base["oracle"]] == \
        [("in", "ring#2", 0.990), ("in", "ring", 1.010),
         ("out", "ring#2", 0.935), ("out", "ring", 1.07)]
    assert base["misses"] == 1
    assert verdict.floor([r for r in rows if "#" not in r["algorithm"]]) is None
    assert verdict.main([str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "0 of 2 cells below 0.95" in out
    assert "oracle: 1 of 4" in out and "1 of 4 more than 5.3%" in out


def test_verdict_pairs_the_rounds_to_tell_a_clear_miss_from_noise(tmp_path, capsys):
    """A miss is *clear* where the ratio of the rounds that ``auto`` and the best ran together
    (paired: the machine's slow phases fall on both) stays below 0.95 over resamples; a table
    ratio pulled down by rounds in two modes is not."""
    from bench import verdict
    phases = (1.0, 1.6, 1.0, 1.6, 1.0, 1.6, 1.0, 1.6, 1.6)  # the machine, round by round
    steady = (1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 1.0, 1.01, 0.99)
    res = [_result("ring", "out", 1e-3, rounds=[p * q for p, q in zip(phases, steady)]),
           _result("auto", "out", 1.1e-3, rounds=phases),               # 10% slower, every round
           # the same code in place: auto caught the slow phase in more rounds, not the pick
           _result("ring", "in", 1e-3, rounds=(1.0, 1.6, 1.0, 1.6, 1.0, 1.0, 1.0, 1.6, 1.0)),
           _result("auto", "in", 1e-3, rounds=(1.0, 1.6, 1.6, 1.6, 1.0, 1.6, 1.0, 1.6, 1.6))]
    res[1].picked = res[3].picked = "ring"
    harness.write_json(tmp_path / "r.json", res, {"ranks": 2})
    rows = json.loads((tmp_path / "r.json").read_text())["results"]
    found = {c["mode"]: c for c in verdict.cells(rows)}
    assert found["out"]["miss"] and found["out"]["clear"]
    assert found["out"]["paired"][0] == pytest.approx(1 / 1.1, rel=0.02)
    assert found["out"]["paired"][2] < 0.95
    assert found["in"]["miss"] and not found["in"]["clear"], found["in"]
    assert found["in"]["ratio"] == pytest.approx(1 / 1.6)
    lo, hi = found["in"]["paired"][1:]
    assert lo < 0.95 < hi
    # fewer rounds in common than MIN_ROUNDS: no paired figure, never clear
    assert verdict.interval(rows[0], {**rows[1], "round_ids": [0, 1, 2, 3, 40, 41, 42, 43, 44],
                                      "rounds_us": rows[1]["rounds_us"]}) is None
    assert verdict.main([str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "MISS (clear)" in out and "clearly below (the paired 90% range): 1" in out


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from bench import plot
    res = [_result(a, "out", t, nbytes=b).to_dict() for a, t in (("native", 2e-3),
           ("ring", 1e-3), ("gloo", 3e-3)) for b in (8, 1024, 1 << 20)]
    plot.plot(res, tmp_path / "p.png", {"collective": "allreduce", "ranks": 2,
                                        "dtype": "float32", "op": "sum", "host": "h"})
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "r.json").write_text(json.dumps({"collective": "allreduce", "ranks": 2,
                                                 "results": res}))
    assert plot.main([str(tmp_path / "r.json"), "-o", str(tmp_path / "q.png")]) == 0
    assert (tmp_path / "q.png").exists()


def test_tune_rules_and_merge(tmp_path):
    assert tune.rules([(8, "native"), (32, "native"), (128, "ring"), (512, "ring")]) == \
        [[32, "native"], [None, "ring"]]
    assert tune.rules([(1024, "ring"), (8, "native")]) == [[8, "native"], [None, "ring"]]
    assert tune.rules([]) == []
    # alternates: consecutive sizes merge only where the names are the same
    assert tune.rules([(8, ("native", "tree")), (32, ("native", "tree")), (128, "native"),
                       (512, ("ring", "shm"))]) == \
        [[32, "native", "tree"], [128, "native"], [None, "ring", "shm"]]
    path = tmp_path / "tuning.json"
    data, note = tune.merge(path, "sig", 2, {"allreduce": [[None, "ring"]]})
    assert note is None and data["tables"]["allreduce"] == {"2": [[None, "ring"]]}
    path.write_text(json.dumps(data))
    data, note = tune.merge(path, "sig", 3, {"allreduce": [[64, "native"], [None, "ring"]]})
    assert set(data["tables"]["allreduce"]) == {"2", "3"}
    path.write_text(json.dumps(data))
    data, note = tune.merge(path, "other machine", 2, {"allreduce": [[None, "tree"]]})
    assert "another machine" in note and (tmp_path / "tuning.json.bak").exists()
    assert data["tables"] == {"allreduce": {"2": [[None, "tree"]]}}


def test_rules_name_the_close_algorithms_as_alternates(tmp_path, monkeypatch):
    """tune: the algorithms within 1.5x of the fastest, and those the rule in force named (four
    at most, fastest first), follow the winner in its rule; select: ``candidates`` lists a
    rule's names (the multi-node swap applied to each), ``auto`` returns the first."""
    from collectives import select
    row = [_result("native", "out", 1.00e-3), _result("ring", "out", 0.95e-3),
           _result("tree", "out", 1.10e-3), _result("shm", "out", 1.50e-3),
           _result("binomial", "out", 1.15e-3)]
    assert tune.alternates(row, row[0]) == ("ring", "tree", "binomial")  # the incumbent kept
    assert tune.alternates(row, row[1]) == ("native", "tree", "binomial")
    assert tune.alternates(row[3:4], row[3]) == ()
    many = row + [_result("rabenseifner", "out", 1.05e-3), _result("bruck", "out", 1.2e-3)]
    assert tune.alternates(many, row[1]) == ("native", "rabenseifner", "tree", "binomial")
    few = row[:3] + row[3:4]  # native, ring, tree, shm (1.58x: not close)
    assert tune.alternates(few, row[1]) == ("native", "tree")
    assert tune.alternates(few, row[1], ("shm", "gone")) == ("native", "tree", "shm")  # named
    # the built-in rule's names stay, past the cap and however slow this run measured them
    assert tune.alternates(many, row[1], (), ("shm", "gone", "ring")) == \
        ("native", "rabenseifner", "tree", "binomial", "shm")
    assert tune.alternates(few, row[1], ("tree",), ("shm",)) == ("native", "tree", "shm")
    # on one node hierarchical_shm is shm: one of the two, and the cap leaves room for another
    twins = [_result("shm", "out", 1.0e-3), _result("hierarchical_shm", "out", 1.01e-3),
             _result("ring", "out", 1.02e-3), _result("tree", "out", 1.03e-3),
             _result("native", "out", 1.04e-3), _result("binomial", "out", 1.05e-3),
             _result("rabenseifner", "out", 1.06e-3)]
    assert tune.alternates(twins, twins[0]) == ("ring", "tree", "native", "binomial")
    assert tune.alternates(twins, twins[2], (), ("hierarchical_shm",)) == \
        ("shm", "tree", "native", "binomial")
    assert tune.alternates(twins, twins[0], single_node=False) == \
        ("hierarchical_shm", "ring", "tree", "native")
    # past the cap, the fastest close one of each way of moving data left out (shm, then
    # native; recursive doubling, another point-to-point schedule, stays out), but not one
    # past 1.5x
    ways = [_result("rabenseifner", "out", 1.00e-3), _result("ring", "out", 1.01e-3),
            _result("tree", "out", 1.02e-3), _result("binomial", "out", 1.03e-3),
            _result("bruck", "out", 1.04e-3), _result("hierarchical_shm", "out", 1.10e-3),
            _result("shm", "out", 1.18e-3), _result("native", "out", 1.2e-3),
            _result("recursive_doubling", "out", 1.3e-3)]
    assert tune.alternates(ways, ways[0]) == \
        ("ring", "tree", "binomial", "bruck", "hierarchical_shm", "native")
    assert tune.alternates(ways[:5] + ways[6:8], ways[0]) == \
        ("ring", "tree", "binomial", "bruck", "shm", "native")
    assert tune.alternates(ways[:5] + [_result("shm", "out", 1.6e-3)], ways[0]) == \
        ("ring", "tree", "binomial", "bruck")
    # within the cap already: nothing more
    assert tune.alternates(ways[:3] + ways[6:], ways[0]) == \
        ("ring", "tree", "shm", "native")
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"version": 1, "tables": {"allreduce": {
        "2": [[100, "native"], [None, "shm", "ring", "nope"]]}}}))
    monkeypatch.setenv("COLLECTIVES_TUNING", str(path))
    select.load_table(reload=True)
    assert select.candidates("allreduce", 64, 2) == ("native",)
    assert select.candidates("allreduce", 4096, 2) == ("shm", "ring")    # unknown names dropped
    assert select.auto("allreduce", 4096, 2) == "shm"
    assert select.candidates("allreduce", 4096, 2, single_node=False) == \
        ("hierarchical_shm", "ring")


def test_tuning_file_is_what_select_reads(tmp_path, monkeypatch):
    from collectives import select
    path = tmp_path / "t.json"
    monkeypatch.setenv("COLLECTIVES_TUNING", str(path))
    assert tune.tuning_file() == path
    data, _ = tune.merge(path, "sig", 2, {"allreduce": [[100, "native"], [None, "tree"]]})
    path.write_text(json.dumps(data))
    assert select.auto("allreduce", 64, 2) == "native"
    assert select.auto("allreduce", 1000, 2) == "tree"
    # in place: rules of its own where measured, the others elsewhere
    data, _ = tune.merge(path, "sig", 2, {"allreduce in-place": [[1000, "native"],
                                                                 [None, "ring"]],
                                          "reduce": [[None, "binomial"]]})
    assert data["tables"]["allreduce"]["2"] == [[100, "native"], [None, "tree"]]
    assert data["tables"]["allreduce"]["in-place"]["2"] == [[1000, "native"], [None, "ring"]]
    path.write_text(json.dumps(data))
    select.load_table(reload=True)
    assert select.auto("allreduce", 1000, 2, inplace=True) == "native"
    assert select.auto("allreduce", 1000, 2, inplace=False) == "tree"
    assert select.auto("allreduce", 4096, 2, inplace=True) == "ring"
    # reduce is in place on its root only: one set of rules, or the ranks would disagree
    data["tables"]["reduce"]["in-place"] = {"2": [[None, "native"]]}
    path.write_text(json.dumps(data))
    select.load_table(reload=True)
    assert select.auto("reduce", 4096, 2, inplace=True) == "binomial"
    # the file's in-place rules join the built-in ones size by size
    data["tables"]["allreduce"]["in-place"] = {"4": [[None, "tree"]]}
    path.write_text(json.dumps(data))
    select.load_table(reload=True)
    assert select.auto("allreduce", 4096, 4, inplace=True) == "tree"
    # n = 2 in place: the built-in rule, not the file's out-of-place tree
    builtin = next(rule[1] for rule in select.DEFAULT_TABLE["allreduce"]["in-place"]["2"]
                   if rule[0] is None or 600 << 10 <= rule[0])
    assert builtin != "tree" and select.auto("allreduce", 600 << 10, 2, inplace=True) == builtin
    # a size with no in-place rules (none smaller either, no default): the others
    assert select._rules({"allreduce": {"2": [[None, "ring"]], "in-place": {"4": []}}},
                         "allreduce", 2, True) == [(None, ("ring",))]


def test_validation_markdown():
    from bench.model import markdown
    rows = [{"ranks": 2, "size": s, "algorithm": a, "measured_us": t, "ratio": r}
            for s, a, t, r in ((1 << 20, "ring", 400.0, 1.25), (1 << 20, "tree", 700.0, 0.5),
                               (4 << 20, "ring", 1600.0, 1.0))]
    lines = markdown(rows).splitlines()
    assert lines[0] == "| n = 2, size | ring | tree |"
    assert lines[2] == "| 1M | 400 (1.25) | 700 (0.50) |"
    assert lines[3] == "| 4M | 1600 (1.00) |  |"


def test_dispatch(monkeypatch, capsys):
    from bench import __main__ as entry
    assert entry.main([]) == 0 and "commands" in capsys.readouterr().out
    assert entry.main(["nope"]) == 2
    seen = {}

    class Fake:
        @staticmethod
        def main(argv):
            seen["argv"] = argv
            return 0

    import importlib
    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module",
                        lambda name: Fake if name == "bench.ddp" else real(name))
    assert entry.main(["ddp", "--steps", "3"]) == 0
    assert seen["argv"] == ["--steps", "3"]


# -- under mpiexec --------------------------------------------------------------------------
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep +
                       os.environ.get("PATH", ""))


def _run(args, timeout=200, env=None):
    cmd = ["timeout", str(timeout), MPIEXEC, "-n", "2", sys.executable, "-m", "bench"] + args
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout + 20,
                          env=dict(os.environ, **(env or {})))


@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec")
def test_allreduce_benchmark_under_mpiexec(tmp_path):
    import collectives
    out = tmp_path / "r.json"
    p = _run(["allreduce", "-b", "8", "-e", "64K", "-f", "8", "--rounds", "1", "--budget", "2",
              "--json", str(out)])
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [ln.split() for ln in p.stdout.splitlines() if ln and not ln.startswith("#")]
    want = set(collectives.algorithms("allreduce")) | {"auto"}
    assert want <= {r[5] for r in rows}
    data = json.loads(out.read_text())
    assert {r["size"] for r in data["results"]} == {8, 64, 512, 4096, 32768}
    assert want <= {r["algorithm"] for r in data["results"]}
    assert all(r["wrong"] == 0 for r in data["results"]), \
        [r for r in data["results"] if r["wrong"]]
    assert all(r["time_us"] > 0 for r in data["results"])
    assert "# Avg bus bandwidth" in p.stdout and "memory bandwidth" in p.stdout
    # the pick is the table's: every auto row names a registered algorithm
    picked = [r["picked"] for r in data["results"] if r["algorithm"] == "auto"]
    assert picked and set(picked) <= want - {"auto"}, picked
    # a trial's figures, where auto ran one, name what it picked among what it measured
    trials = [(r["picked"], r["trial_us"]) for r in data["results"] if r["algorithm"] == "auto"]
    assert all(t is None or (pk in t and min(t.values()) > 0) for pk, t in trials), trials
    assert "# auto ran: " in p.stdout


@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec")
def test_twin_rows_under_mpiexec(tmp_path):
    """``--twin``: a second row of each algorithm's code, checked like the first (#wrong 0),
    in the table and the JSON; a twin of auto is refused."""
    out = tmp_path / "r.json"
    p = _run(["allreduce", "-b", "8", "-e", "512", "-f", "64", "--rounds", "2", "--settle", "0",
              "--algorithms", "native,ring", "--twin", "--json", str(out)])
    assert p.returncode == 0, p.stdout + p.stderr
    assert {"ring#2", "native#2"} <= {ln.split()[5] for ln in p.stdout.splitlines()
                                      if ln and not ln.startswith("#")}
    data = json.loads(out.read_text())["results"]
    assert {r["algorithm"] for r in data} == {"native", "ring", "native#2", "ring#2"}
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in data)
    p = _run(["allreduce", "--algorithms", "auto#2"], timeout=60)
    assert p.returncode != 0 and "unknown algorithm" in p.stderr, p.stdout + p.stderr


@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec")
def test_tune_under_mpiexec_writes_a_table_auto_reads(tmp_path):
    path = tmp_path / "tuning.json"
    rows = tmp_path / "rows.json"
    p = _run(["tune", "--collectives", "allreduce,broadcast", "-b", "8", "-e", "4K", "-f", "16",
              "--rounds", "1", "--budget", "2", "-o", str(path), "--json", str(rows)])
    assert p.returncode == 0, p.stdout + p.stderr
    # --json: every measured row, every registered algorithm at every size and mode
    got = json.loads(rows.read_text())
    assert got["tune"] and got["ranks"] == 2
    seen = {(r["collective"], r["algorithm"], r["size"], r["mode"]) for r in got["results"]}
    import collectives
    for c, modes in (("allreduce", ("out", "in")), ("broadcast", ("in",))):
        assert {(c, a, s, m) for a in collectives.algorithms(c) for s in (8, 128, 2048)
                for m in modes} <= seen
    assert all(r["time_us"] > 0 and r["wrong"] == 0 for r in got["results"])
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["signature"]
    for table in (data["tables"]["allreduce"]["2"], data["tables"]["broadcast"]["2"],
                  data["tables"]["allreduce"]["in-place"]["2"]):  # allreduce: both modes
        assert table[-1][0] is None and all(isinstance(name, str) for _, *names in table
                                            for name in names)
    assert "in-place" not in data["tables"]["broadcast"]
    assert "auto before" in p.stdout and "auto after" in p.stdout


def test_drift_over_ragged_rounds():
    """Contenders run extra rounds (Sweep._settle): a round's factor comes from the algorithms
    that ran in it, and a round only one algorithm ran in keeps the factor 1."""
    native = _result("native", "out", 1e-5, rounds=(1.0, 1.5, 1.0, 1.5, 1.5, 2.0))
    auto = _result("auto", "out", 1e-5, rounds=(1.0, 1.5, 1.0, 1.5, 1.0))
    ring = _result("ring", "out", 4e-5, rounds=(1.0, 1.5, 1.0))
    native.round_ids = [0, 1, 2, 3, 4, 5]
    auto.round_ids = [0, 1, 2, 3, 4]
    ring.round_ids = [0, 1, 2]
    harness.correct_drift([native, auto, ring])
    assert len(native.drift) == 6 and len(auto.drift) == 5 and len(ring.drift) == 3
    # round 1: every algorithm 1.5x its median; round 3: native at, auto 1.5x above its
    # median (a median of two); round 5: native alone
    assert native.drift == pytest.approx([1.0, 1.5, 1.0, 1.5 ** 0.5, 1.0, 1.0])
    assert ring.drift == pytest.approx([1.0, 1.5, 1.0]) and ring.time == pytest.approx(4e-5)
    assert auto.to_dict()["round_ids"] == [0, 1, 2, 3, 4]


def test_race_keeps_the_best_auto_and_the_close():
    """After the first rounds, the clearly slower contenders leave the race; the best, auto and
    those within the noise stay."""
    steady = tuple(1.0 + 0.01 * (k % 3) for k in range(21))
    best = _result("ring", "out", 1e-3, rounds=steady)
    close = _result("shm", "out", 1.01e-3, rounds=steady)
    slow = _result("tree", "out", 1.3e-3, rounds=steady)
    auto = _result("auto", "out", 1.4e-3, rounds=steady)        # a bad pick stays measured
    other = _result("ring", "in", 2e-3, rounds=steady)          # alone in its mode: the best
    results = {(r.algorithm, r.mode): r for r in (best, close, slow, auto, other)}
    stay = harness._race(list(results), results)
    assert set(stay) == {("ring", "out"), ("shm", "out"), ("auto", "out"), ("ring", "in")}
    assert harness.median_error(best) < 0.01
    assert harness.median_error(_result("x", "out", 1e-3, rounds=(1.0, 1.1))) == float("inf")


def test_race_ends_when_autos_gap_to_the_best_is_known():
    """Each median known to the target is not enough: the gap between auto and the best (the
    ratio a reader takes from the table) must be known to it too."""
    def spread(sd, k):  # k rounds whose median absolute deviation is sd / 1.4826
        return tuple(math.exp(sd / 1.4826 * (i % 3 - 1)) for i in range(k))
    k = 27
    each = 0.009 * math.sqrt(k) / 1.2533  # per-round sd that puts each median at 0.9%
    best = _result("native", "out", 1e-5, rounds=spread(each, k))
    auto = _result("auto", "out", 1.01e-5, rounds=spread(each, k))
    assert harness.median_error(best) == pytest.approx(0.009)
    results = {("native", "out"): best, ("auto", "out"): auto}
    keys = list(results)
    assert not harness._resolved(keys, results, 0.01)       # the gap: 0.9% x sqrt 2 > 1%
    assert harness._resolved(keys, results, 0.013)
    fast = _result("auto", "out", 0.9e-5, rounds=spread(each, k))  # auto the best: no gap
    assert harness._resolved(keys, {("native", "out"): best, ("auto", "out"): fast}, 0.01)
    assert harness._resolved([("native", "out")], results, 0.01)  # auto not racing here
    assert not harness._resolved(keys, results, 0.005)      # a median itself not known


def test_sweep_races_the_contenders_only():
    """On one rank (COMM_SELF): every algorithm runs --rounds rounds; auto and whatever is
    within 1.5x of the fastest run more, up to max_rounds, numbered after the first ones."""
    from mpi4py import MPI
    spec = tune.spec("allreduce")
    sweep = harness.Sweep(spec, MPI.COMM_SELF, algorithms=["native", "auto"], rounds=3,
                          budget=0.0005, check=False, modes=["out"], max_rounds=9,
                          target=0.0, settle=5.0)
    slow = harness.Sweep(spec, MPI.COMM_SELF, algorithms=["native", "auto"], rounds=3,
                         budget=0.0005, check=False, modes=["out"], max_rounds=9,
                         target=0.0, settle=0.0)
    res = {r.algorithm: r for r in sweep.run_size(1 << 12)}
    assert len(res["native"].rounds) == len(res["auto"].rounds) == 9
    assert res["auto"].ids() == list(range(9)) and res["auto"].extra_iters >= 1
    assert res["auto"].drift is not None and len(res["auto"].drift) == 9
    assert all(len(r.rounds) == 3 for r in slow.run_size(1 << 12))  # settle=0: no race


def test_sweep_races_the_incumbent_too(monkeypatch):
    """tune's sweep: the algorithm auto runs now is a contender even when the first rounds put
    it past 1.5x of the fastest (an algorithm in a lucky fast mode raced no one before)."""
    from mpi4py import MPI
    spec = tune.spec("allreduce")
    # In one process both algorithms are the same trivial call, and one of them left the race
    # now and then as "clearly slower" by chance (6 rounds of 9): no one leaves on noise here;
    # the race's own verdicts are checked on fixed rounds below.
    monkeypatch.setattr(harness, "noise", lambda a, b: math.inf)
    seen = []

    def incumbent(nbytes, mode):
        seen.append((nbytes, mode))
        return "ring"
    sweep = harness.Sweep(spec, MPI.COMM_SELF, algorithms=["native", "ring"], rounds=3,
                          budget=0.0005, check=False, modes=["out"], max_rounds=9,
                          target=0.0, settle=5.0, incumbent=incumbent)
    res = {r.algorithm: r for r in sweep.run_size(1 << 12)}
    assert len(res["native"].rounds) == len(res["ring"].rounds) == 9
    assert seen and seen[0] == (1 << 12, "out")
    assert sweep._kept(1 << 12, "out") == {"auto", "ring"}
    monkeypatch.undo()
    # the race keeps the incumbent however slow; without it, the clearly slower one leaves
    steady = tuple(1.0 + 0.01 * (k % 3) for k in range(21))
    fast = _result("binomial", "out", 0.6e-3, rounds=steady)
    tree = _result("tree", "out", 1.0e-3, rounds=steady)
    results = {("binomial", "out"): fast, ("tree", "out"): tree}
    assert harness._race(list(results), results) == [("binomial", "out")]
    assert harness._race(list(results), results, {("tree", "out")}) == list(results)


def test_tune_keeps_what_auto_runs_within_the_noise():
    """A rule changes only where the fastest beats auto's current pick clearly: by more than 3%
    and three standard errors of the difference."""
    steady = tuple(1.0 + 0.002 * (k % 3) for k in range(21))
    noisy = tuple(1.0 + 0.2 * (k % 3 - 1) for k in range(21))
    shm = _result("shm", "out", 1.02e-3, rounds=steady)
    dbt = _result("double_binary_tree", "out", 1.0e-3, rounds=steady)
    ring = _result("ring", "out", 1.2e-3, rounds=steady)
    assert tune.winner([dbt, shm, ring], "shm") is shm          # 2% behind: kept
    assert tune.winner([dbt, shm, ring], "ring") is dbt         # 20% behind: replaced
    assert tune.winner([dbt, shm, ring], None) is dbt           # nothing to keep
    assert tune.winner([dbt, shm, ring], "tree") is dbt         # not measured here
    wobbly = _result("tree", "out", 1.08e-3, rounds=noisy)      # 8%, but within its noise
    assert tune.winner([dbt, wobbly], "tree") is wobbly
    assert tune.winner([dbt, _result("tree", "out", 1.08e-3, rounds=steady)], "tree") is dbt
    # two modes: fast in 11 of 21 rounds (a median that wins), 3x slower in the rest
    modal = _result("binomial", "out", 0.6e-3, rounds=tuple(1.0 if k % 2 == 0 else 3.0
                                                             for k in range(21)))
    tree = _result("tree", "out", 1.0e-3, rounds=steady)
    assert modal.time < tree.time and tune.winner([modal, tree], "tree") is tree
    assert tune.winner([modal, tree], None) is modal           # nothing to keep


def test_tune_leads_a_reduction_with_an_algorithm_auto_can_race():
    """At more than 2 ranks a reduction's rule whose first combines in an order of its own
    (select.bits) cannot race; the fastest of those that can race another of the row leads
    instead when within 5% or the noise: tree or shm where shm combines as tree does, ring or
    shm (or hierarchical, on one node) where shm combines as ring does."""
    steady = tuple(1.0 + 0.002 * (k % 3) for k in range(21))
    noisy = tuple(1.0 + 0.2 * (k % 3 - 1) for k in range(21))
    native = _result("native", "out", 1.0e-3, rounds=steady)
    shm = _result("shm", "out", 1.04e-3, rounds=steady)
    tree = _result("tree", "out", 1.03e-3, rounds=steady)
    ring = _result("ring", "out", 1.01e-3, rounds=steady)
    hier = _result("hierarchical", "out", 1.02e-3, rounds=steady)
    row = [native, shm, tree, ring]
    big = 1 << 20  # shm's allreduce combines as ring above 512 KiB
    assert tune.raceable(row, native, "allreduce", 3) is tree       # the fastest of the two
    assert tune.raceable(row, native, "allreduce", 3, nbytes=big) is ring
    assert tune.raceable(row, native, "reduce", 3, nbytes=big) is tree
    assert tune.raceable(row, native, "reduce_scatter", 3) is ring
    assert tune.raceable(row, native, "allreduce", 2) is native     # 2 ranks: everything races
    assert tune.raceable(row, native, "allgather", 3) is native     # data movement races too
    assert tune.raceable(row, shm, "allreduce", 3) is shm           # already raceable
    assert tune.raceable([native, hier, ring], hier, "allreduce", 3) is hier
    assert tune.raceable([hier, ring, shm], hier, "reduce_scatter", 3) is hier
    # on several nodes (or NUMA groups) hierarchical combines in an order of its own
    for where in ({"single_node": False}, {"numa": True}):
        assert tune.raceable([hier, ring, shm], hier, "reduce_scatter", 3, where=where) is ring
    slow = [_result("tree", "out", 1.08e-3, rounds=steady),
            _result("shm", "out", 1.09e-3, rounds=steady)]
    assert tune.raceable([native] + slow, native, "allreduce", 3) is native  # 8%: clearly slower
    assert tune.raceable([native, slow[0]], native, "allreduce", 3) is native  # none to race
    wobbly = _result("tree", "out", 1.08e-3, rounds=noisy)
    assert tune.raceable([native, wobbly, slow[1]], native, "allreduce", 3) is wobbly  # noise
    assert tune.raceable([native, ring], native, "allreduce", 3) is native   # none to race
    # what auto runs now keeps its lead: the built-in rule is the evidence of many runs
    assert tune.raceable(row, native, "allreduce", 3, "native") is native
    assert tune.raceable(row, native, "allreduce", 3, "ring") is tree


def test_tune_wants_more_to_replace_a_pick_auto_cannot_race():
    """Where auto could not race the fastest against what it runs now (a reduction at more
    than 2 ranks, but for tree against shm), the fastest needs KEEP_FINAL (5%), not KEEP."""
    from collectives import select
    steady = tuple(1.0 + 0.002 * (k % 3) for k in range(21))
    shm = _result("shm", "out", 1.0e-3, rounds=steady)
    native = _result("native", "out", 1.04e-3, rounds=steady)
    for nbytes in (64, 1 << 20):
        assert select.races("allreduce", 2, "native", "shm", nbytes)
        assert select.races("broadcast", 3, "native", "shm", nbytes)
        assert select.races("reduce", 3, "tree", "shm", nbytes)
        assert select.races("reduce_scatter", 3, "ring", "shm", nbytes)
        assert not select.races("allreduce", 3, "native", "shm", nbytes)
        assert not select.races("reduce_scatter", 3, "native", "shm", nbytes)
    assert select.races("allreduce", 3, "tree", "shm", 64)
    assert not select.races("allreduce", 3, "ring", "shm", 64)
    assert select.races("allreduce", 3, "ring", "shm", 1 << 20)
    assert not select.races("allreduce", 3, "tree", "shm", 1 << 20)
    assert tune.winner([shm, native], "native") is shm                     # 4% > KEEP
    assert tune.winner([shm, native], "native", tune.KEEP_FINAL) is native
    clear = _result("native", "out", 1.07e-3, rounds=steady)
    assert tune.winner([shm, clear], "native", tune.KEEP_FINAL) is shm     # 7%: replaced


def test_tune_picks_a_reduce_for_both_modes():
    """A reduce's rules serve its in-place calls too (only the root knows): where the modes
    rank the algorithms differently, the rule takes the one best in the worse of the two."""
    out = {a: _result(a, "out", t) for a, t in
           (("tree", 1.0e-3), ("shm", 1.04e-3), ("binomial", 1.02e-3))}
    inp = [_result(a, "in", t) for a, t in (("tree", 1.0e-3), ("shm", 0.7e-3),
                                             ("binomial", 1.05e-3))]
    row = list(out.values())
    assert tune.either_mode(row, inp, out["tree"]) is out["shm"]     # 0.96 against 0.70
    assert tune.either_mode(row, [], out["tree"]) is out["tree"]     # no in-place row
    # both ways a miss: the less bad stays (tree 0.96 in place, shm 0.83 out of place)
    conflict = [_result("tree", "out", 0.91e-3), _result("shm", "out", 1.10e-3)]
    there = [_result("tree", "in", 0.90e-3), _result("shm", "in", 0.86e-3)]
    assert tune.either_mode(conflict, there, conflict[0]) is conflict[0]
    assert tune.either_mode(conflict, there, conflict[1]) is conflict[0]
    # within KEEP of each other: what won stays
    close = [_result("tree", "out", 1.0e-3), _result("shm", "out", 1.02e-3)]
    near = [_result("tree", "in", 1.0e-3), _result("shm", "in", 0.99e-3)]
    assert tune.either_mode(close, near, close[0]) is close[0]
    assert tune.either_mode(close, near, close[1]) is close[1]


def test_race_brings_back_the_fastest_of_the_row():
    """The row's fastest other than auto, out of the race (its median from a few rounds,
    drift-corrected since), runs again (``_rejoin``), so that the figure auto is compared with
    is known as well as auto's; a slower one stays out, and so does every other mode."""
    steady = tuple(1.0 + 0.01 * (k % 3) for k in range(21))
    ring = _result("ring", "out", 1.0e-3, rounds=steady)
    auto = _result("auto", "out", 1.02e-3, rounds=steady)
    hier = _result("hierarchical", "out", 0.9e-3, rounds=steady[:9])   # out after 9 rounds
    tree = _result("tree", "out", 1.3e-3, rounds=steady[:9])
    inplace = _result("ring", "in", 0.5e-3, rounds=steady[:9])          # not racing
    results = {(r.algorithm, r.mode): r for r in (ring, auto, hier, tree, inplace)}
    keys = [("ring", "out"), ("auto", "out")]
    assert harness._rejoin(keys, results) == keys + [("hierarchical", "out")]
    assert keys == [("ring", "out"), ("auto", "out")]  # a new list
    hier.rounds = [1.2e-3 * t for t in steady[:9]]                      # slower now
    assert harness._rejoin(keys, results) == keys
    # auto the fastest, racing alone: the best of the others runs beside it again, so that
    # their rounds share the drift correction (a round one algorithm ran in has none)
    auto.rounds = [0.5e-3 * t for t in steady]
    assert harness._rejoin([("auto", "out")], results) == [("auto", "out"), ("ring", "out")]


def test_sweep_races_the_best_other_beside_an_auto_far_ahead(monkeypatch):
    """On one rank (COMM_SELF), with the blocks' times set: auto, native's code, 3x ahead of
    native in the first rounds (past CONTEND): native still races beside it, every round (the
    figure auto is compared with; before, nothing raced, and 7 rounds in two states stood)."""
    from mpi4py import MPI
    spec = tune.spec("allreduce")
    real = harness.Sweep._block

    def block(self, fn, iters, res, est, round_id=None):
        spent = real(self, fn, iters, res, est, round_id)
        k = len(res.rounds)
        slow = 3.0 if res.algorithm == "native" and k <= 7 else 1.0
        jitter = 0.01 * (k % 3 if res.algorithm == "native" else k % 4)  # not all drift
        res.rounds[-1] = 1e-5 * (1.0 + jitter) * slow
        return spent
    monkeypatch.setattr(harness.Sweep, "_block", block)
    sweep = harness.Sweep(spec, MPI.COMM_SELF, algorithms=["native", "auto"], rounds=7,
                          budget=0.0005, check=False, modes=["out"], max_rounds=30,
                          target=0.0, settle=5.0)
    res = {r.algorithm: r for r in sweep.run_size(1 << 12)}
    assert len(res["native"].rounds) == len(res["auto"].rounds) == 30
    assert res["native"].time == pytest.approx(res["auto"].time, rel=0.02)


def test_gloo_runs_after_every_other_row(monkeypatch):
    """On one rank (COMM_SELF), a stand-in for gloo's call: its process group starts only
    after every other block of every size, race included, and its blocks run then, in rounds
    of their own (ids past the others'), so that neither its collectives nor its group's
    threads disturb another row; the sweep's output gets each size's gloo rows after all the
    others'."""
    from mpi4py import MPI
    spec = tune.spec("allreduce")
    real_calls, real_block = harness.Sweep._callables, harness.Sweep._block
    seen, shown = [], []

    def callables(self, coll, count, algorithms=None):
        if algorithms == ["gloo"]:  # native's calls, named gloo
            import collectives
            calls, cin = real_calls(self, collectives, count, ["native"])
            return {("gloo", mode): call for (_, mode), call in calls.items()}, cin
        return real_calls(self, coll, count, algorithms)

    def block(self, fn, iters, res, est, round_id=None):
        seen.append(res.algorithm)
        return real_block(self, fn, iters, res, est, round_id)

    def start(self):
        if self._gloo is None:
            seen.append("start")
            self._gloo = object()
        return self._gloo
    monkeypatch.setattr(harness.Sweep, "_callables", callables)
    monkeypatch.setattr(harness.Sweep, "_block", block)
    monkeypatch.setattr(harness.Sweep, "_start_gloo", start)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    sweep = harness.Sweep(spec, MPI.COMM_SELF, algorithms=["native", "auto", "gloo"], rounds=3,
                          budget=0.0005, check=True, modes=["out"], max_rounds=9,
                          target=0.0, settle=5.0,
                          out=lambda res, late=False: shown.append(
                              (late, sorted({r.algorithm for r in res}))))
    res = sweep.run([1 << 10, 1 << 12])
    first = seen.index("start")
    assert seen[first + 1:] == ["gloo"] * 6 and "gloo" not in seen[:first]
    assert len(seen[:first]) == 2 * 2 * 9  # native and auto, two sizes: 3 rounds, race to 9
    gloo = [r for r in res if r.algorithm == "gloo"]
    assert [r.nbytes for r in gloo] == [1 << 10, 1 << 12]
    assert all(r.ids() == [9, 10, 11] and r.wrong == 0 for r in gloo)
    assert all(r.ids() == list(range(9)) for r in res if r.algorithm == "native")
    assert shown == [(False, ["auto", "native"])] * 2 + [(True, ["auto", "gloo", "native"])] * 2


def test_gloo_is_skipped_with_a_note_for_a_dtype_it_has_no_kernel_for(monkeypatch):
    """gloo refuses some dtypes at its first call, on every rank (uint32: "Invalid scalar
    type"): the sweep leaves it out before it starts, with a note, and the other rows run."""
    from mpi4py import MPI
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    started = []
    monkeypatch.setattr(harness.Sweep, "_start_gloo", lambda self: started.append(1))
    for dtype, note in (("uint32", "gloo has no uint32, skipped"),
                        ("bool", "gloo has no bool, skipped")):
        sweep = harness.Sweep(tune.spec("allreduce"), MPI.COMM_SELF, dtype=dtype,
                              op="bor" if dtype == "bool" else "sum",
                              algorithms=["native", "gloo"], rounds=2, budget=0.0005,
                              modes=["out"], settle=0.0)
        assert sweep.algorithms == ["native"] and sweep.notes == [note]
        res = sweep.run([1 << 10])
        assert [r.algorithm for r in res] == ["native"] and res[0].wrong == 0
    assert not started


def test_a_rule_keeps_the_other_modes_fastest():
    """tune: the other mode's fastest at a size stays among a rule's alternates, however slow
    this mode measured it (a tune at 2 ranks timed shm out of place at 1.6x recursive
    doubling, seventh, where in place it led, and the benchmark after ran it the fastest out of
    place too); a reduce's rule serves both modes (``shared``: ``either_mode``)."""
    out = [_result(a, "out", t * 1e-6) for a, t in (
        ("recursive_doubling", 80), ("rabenseifner", 95), ("double_binary_tree", 97),
        ("hierarchical", 100), ("ring", 102), ("hierarchical_shm", 126), ("shm", 128))]
    inp = [_result(a, "in", t * 1e-6) for a, t in (("shm", 116), ("hierarchical_shm", 124),
                                                    ("ring", 172))]
    win, names = tune.choice("allreduce", 2, out, inp, ("recursive_doubling",))
    assert win is out[0]
    assert names == ("recursive_doubling", "rabenseifner", "double_binary_tree",
                     "hierarchical", "ring", "shm")
    win, names = tune.choice("allreduce", 2, out, [], ("recursive_doubling",), ("ring",))
    assert "shm" not in names and names[:1] == ("recursive_doubling",)
    # the other mode's fastest is the winner itself: nothing added
    assert tune.choice("allreduce", 2, out[:2], [_result("recursive_doubling", "in", 9e-5)])[1] \
        == ("recursive_doubling", "rabenseifner")
    # a reduce: in place ranks shm first by far, out of place it is 4% behind tree
    tree, shm = _result("tree", "out", 1.0e-3), _result("shm", "out", 1.04e-3)
    there = [_result("tree", "in", 1.0e-3), _result("shm", "in", 0.7e-3)]
    assert tune.choice("reduce", 2, [tree, shm], there, ("tree",), shared=True)[0] is shm
    assert tune.choice("reduce", 2, [tree, shm], there, ("tree",))[0] is tree


def test_every_block_starts_with_an_untimed_call():
    """A timed block of ``iters`` calls runs one untimed call first, whatever the call's length:
    the row times the algorithm's steady state, not the switch from the block before (at
    8 MiB, 3 ranks, native's broadcast right after another algorithm took 1.5x its time)."""
    class Comm:
        def Get_size(self):
            return 1

        def Barrier(self):
            pass

        def Allgather(self, send, recv):
            recv[:] = send

    sweep = object.__new__(harness.Sweep)
    sweep.comm = Comm()
    for est in (1e-6, 5e-3, 2.0):
        calls, res = [], _result("native", "in", 1e-3, rounds=())
        res.ranks_t = []
        spent = sweep._block(lambda: calls.append(1), 3, res, est, round_id=None)
        assert len(calls) == 4 and len(res.rounds) == 1 and spent >= est, (est, len(calls))


def test_readme_table_of_auto_is_the_built_in_table():
    """The README's table of what ``auto`` runs is ``select.DEFAULT_TABLE`` in words: a rule
    changed in the code and not in the README (it had drifted at 6 of 12 cells) fails here."""
    from collectives import select
    lines = (Path(__file__).resolve().parents[1] / "README.md").read_text().splitlines()
    start = lines.index("| collective | n = 2 | n = 3 and more |") + 2
    readme = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        name, two, three = (cell.strip() for cell in line.strip("|").split("|"))
        readme[name] = (two, three)
    table = select.DEFAULT_TABLE
    expected = {c: (select.describe(table[c]["2"]), select.describe(table[c]["3"]))
                for c in select.COLLECTIVES}
    expected["allreduce in place"] = tuple(select.describe(table["allreduce"]["in-place"][n])
                                           for n in ("2", "3"))
    assert readme == expected
    assert select.describe([[32 << 10, "native"], [None, "ring", "double_binary_tree"]]) == \
        "native ≤ 32 KiB, ring (or double binary tree)"


def test_bench_runs_outside_the_checkout(tmp_path):
    """``bench`` installs with the package: ``python -m bench`` from another directory (it
    failed there with "No module named bench" while only the checkout's root had it)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "bench", "model", "--ranks", "8",
                           "--ranks-per-node", "4", "--bytes", "1M"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "# fastest:" in done.stdout
