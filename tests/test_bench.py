"""The benchmark: its pieces in process, and small real runs under mpiexec."""
import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import harness, overhead, report, stats, tune, units
from bench.allgather import Allgather
from bench.allreduce import Allreduce
from bench.collective import AVG_BOUND, busbw_factor, expected_reduce, rank_data
from bench.reduce_scatter import ReduceScatter

ROOT = Path(__file__).resolve().parent.parent


# -- sizes and units ---------------------------------------------------------------------------
def test_parse_size_takes_suffixes():
    assert units.parse_size("8") == 8
    assert units.parse_size("64K") == 64 << 10
    assert units.parse_size("64k") == 64 << 10
    assert units.parse_size("16M") == 16 << 20
    assert units.parse_size("64M") == 64 << 20
    assert units.parse_size("1G") == 1 << 30
    assert units.parse_size("1KiB") == 1024
    assert units.parse_size("256MB") == 256 << 20
    assert units.parse_size("1.5K") == 1536
    assert units.parse_size(12) == 12
    assert units.parse_size(np.int64(12)) == 12
    for bad in ("", "M", "12Q", "-1", "0.5", "1.5"):
        with pytest.raises(ValueError):
            units.parse_size(bad)


def test_parse_time_and_rate():
    assert units.parse_time("5us") == pytest.approx(5e-6)
    assert units.parse_time("1.5ms") == pytest.approx(1.5e-3)
    assert units.parse_time("2e-6") == pytest.approx(2e-6)
    assert units.parse_rate("25GB/s") == pytest.approx(25e9)
    assert units.parse_rate("100Gb/s") == pytest.approx(12.5e9)
    assert units.parse_rate("10GiB/s") == pytest.approx(10 * 2 ** 30)
    assert units.parse_rate("800MB/s") == pytest.approx(8e8)
    with pytest.raises(ValueError):
        units.parse_time("fast")
    for bad in ("25GB", "lots", "5us"):  # "25GB" without /s reads like a size: refused
        with pytest.raises(ValueError):
            units.parse_rate(bad)


def test_sweep_sizes_end_at_the_end_size():
    assert [units.format_size(n) for n in (8, 1024, 3 << 20, 1 << 30, 1536)] == \
        ["8", "1K", "3M", "1G", "1536"]
    assert units.byte_sizes(8, 64, 2) == [8, 16, 32, 64]
    assert units.byte_sizes(8, 100, 4) == [8, 32, 100]
    assert units.byte_sizes(1, 3, 1.5) == [1, 2, 3]
    assert units.byte_sizes(64, 64, 2) == [64]
    # -b 8 -e 64M -f 8: 8 x 8^k stops at 16M; 64M is measured too, once
    sweep = units.byte_sizes(8, units.parse_size("64M"), 8)
    assert [units.format_size(s) for s in sweep] == \
        ["8", "64", "512", "4K", "32K", "256K", "2M", "16M", "64M"]
    assert units.byte_sizes(8, 64 << 20, 4)[-2:] == [32 << 20, 64 << 20]
    with pytest.raises(ValueError):
        units.byte_sizes(64, 8, 2)
    with pytest.raises(ValueError):
        units.byte_sizes(8, 64, 1)


def test_size_options_say_they_take_suffixes():
    from bench.cli import parser
    text = " ".join(parser(Allreduce()).format_help().split())
    assert "suffixes K, M, G" in text and "8, 64K, 16M" in text
    args = parser(Allreduce()).parse_args(["-b", "64K", "-e", "16M", "--rounds", "3"])
    assert units.parse_size(args.minbytes) == 64 << 10 and args.rounds == 3
    for gone in ("--twin", "--max-rounds", "--target", "--settle", "--budget"):
        with pytest.raises(SystemExit):
            parser(Allreduce()).parse_args([gone, "1"])


# -- collectives' data ---------------------------------------------------------------------------
def test_busbw_factors():
    assert busbw_factor("allreduce", 4) == 1.5
    assert busbw_factor("allreduce", 1) == 0
    assert busbw_factor("reduce_scatter", 4) == 0.75
    assert busbw_factor("allgather", 2) == 0.5
    assert busbw_factor("broadcast", 8) == 1
    assert busbw_factor("reduce", 8) == 1
    assert busbw_factor("alltoall", 4) == busbw_factor("gather", 4) == 0.75
    assert busbw_factor("scatter", 2) == 0.5
    with pytest.raises(ValueError, match="unknown collective"):
        busbw_factor("allscatter", 2)


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
    got = expected_reduce(n, count, dtype, op)
    data = np.stack([rank_data(r, count, dtype, op).astype(np.float64) for r in range(n)])
    ref = {"sum": data.sum(0), "avg": data.mean(0), "prod": data.prod(0), "min": data.min(0),
           "max": data.max(0)}[op]
    if op == "avg":  # the exact mean, and (n + 1) roundings of the mean magnitude around it
        assert got.dtype == np.float64 and (got == ref).all()
        unit = float(np.finfo(dtype).eps) / 2
        bound = expected_reduce(n, count, dtype, AVG_BOUND)
        assert np.allclose(bound, (n + 1) * unit / (1 - (n + 1) * unit) * np.abs(data).mean(0),
                           rtol=1e-12, atol=0)
        assert (bound > 0).any()
        return
    assert got.dtype == np.dtype(dtype)
    assert (got.astype(np.float64) == ref).all()
    # rank-dependent: two ranks' data differ
    assert (rank_data(0, count, dtype, op) != rank_data(1, count, dtype, op)).any()


# -- statistics ----------------------------------------------------------------------------------
def test_stats_on_fixed_numbers():
    seven = [5.0, 1.0, 3.0, 2.0, 4.0, 100.0, 3.5]  # one wild round
    assert stats.median(seven) == 3.5
    assert stats.quartiles(seven) == (2.5, 4.5)        # sorted 1 2 3 3.5 4 5 100
    assert stats.spread(seven) == pytest.approx(2.0 / 3.5)
    assert seven[stats.median_round(seven)] == 3.5
    assert stats.median([2.0, 1.0, 4.0, 3.0]) == 2.5
    assert [2.0, 1.0, 4.0, 3.0][stats.median_round([2.0, 1.0, 4.0, 3.0])] == 2.0  # the lower
    assert stats.spread([7.0]) == 0.0 and stats.spread([]) == 0.0
    assert np.isnan(stats.median([]))
    assert stats.spread([1.0, 1.0, 1.0]) == 0.0


def _result(alg, mode, t, nbytes=1024, n=2, wrong=0, rounds=(1.0, 1.0, 1.0)):
    r = stats.Result("allreduce", nbytes, nbytes // 4, "float32", "sum", -1, alg, mode, n,
                     busbw_factor("allreduce", n))
    r.rounds = [t * x for x in rounds]
    r.ranks_t = [[t * x * 0.9, t * x] for x in rounds]
    r.iters, r.wrong = 10, wrong
    return r


def test_result_statistics():
    r = _result("ring", "out", 1e-3, rounds=(1.0, 1.2, 0.9))
    assert r.time == pytest.approx(1e-3)
    assert r.spread == pytest.approx((1.1 - 0.95) / 1.0)
    assert r.algbw == pytest.approx(1024 / 1e-3)
    assert r.busbw == pytest.approx(r.algbw * 1.0)  # 2(n-1)/n = 1 for n = 2
    lo, avg, hi = r.latency()  # of the median round, over ranks
    assert (lo, avg, hi) == (pytest.approx(0.9e-3), pytest.approx(0.95e-3), pytest.approx(1e-3))
    d = r.to_dict()
    assert d["busbw_GBps"] == pytest.approx(r.busbw / 1e9)
    assert (d["min_us"], d["max_us"]) == (pytest.approx(900), pytest.approx(1200))
    assert d["rounds_us"] == pytest.approx([1000, 1200, 900])


# -- the timing loop ------------------------------------------------------------------------------
class _Comm:
    """One rank, no MPI: what ``Sweep``'s blocks use of a communicator."""

    def Get_size(self):
        return 1

    def Get_rank(self):
        return 0

    def Barrier(self):
        pass

    def Allgather(self, send, recv):
        recv[:] = send


def _bare_sweep(rounds=3, iters=5):
    sweep = object.__new__(harness.Sweep)
    sweep.comm, sweep.rounds, sweep.iters, sweep.warmup = _Comm(), rounds, iters, 0
    sweep.block = harness.BLOCK_S
    return sweep


def test_rounds_shuffle_the_order_and_time_a_block_each():
    """Every round runs each key once, in an order that changes: no algorithm always runs
    first, nor always after the same one; the orders are the same on every rank (seeded).
    Each block is one untimed call and ``iters`` timed ones, and each round adds one time."""
    def orders():
        sweep = _bare_sweep(rounds=12, iters=5)
        seen = []
        calls = {(a, "out"): (lambda a=a: seen.append(a), None, None) for a in "abcd"}
        results = {key: _result(key[0], "out", 1e-3, rounds=()) for key in calls}
        for r in results.values():
            r.ranks_t = []
        sweep._time(calls, results)
        assert len(seen) == 12 * 4 * 6
        assert all(len(r.rounds) == 12 and r.iters == 5 and min(r.rounds) > 0
                   for r in results.values())
        blocks = "".join(seen[i] for i in range(0, len(seen), 6))  # 1 + 5 calls per block
        return [blocks[i:i + 4] for i in range(0, len(blocks), 4)]

    rounds = orders()
    assert all(sorted(r) == list("abcd") for r in rounds)
    assert len({r[0] for r in rounds}) > 1
    before_a = {r[r.index("a") - 1] for r in rounds if r.index("a") > 0}
    assert len(before_a) > 1
    assert orders() == rounds


def test_block_length_from_the_slowest_ranks_estimate(monkeypatch):
    """A block lasts about ``BLOCK_S`` (2 ms) at the estimated pace: one timed call, refined
    on a short block when that is far shorter than the block; at most ``MAX_CALLS``."""
    from mpi4py import MPI
    sweep = _bare_sweep(iters=0)
    sweep.comm = MPI.COMM_SELF
    for per_call, want in ((1e-3, 2), (1e-4, 20), (1e-6, harness.MAX_CALLS), (5e-2, 1)):
        asked = []

        def measure(fn, iters, per_call=per_call):
            asked.append(iters)
            return per_call
        monkeypatch.setattr(sweep, "_measure", measure)
        assert sweep._calls_per_block(lambda: None) == want
        assert asked[0] == 1 and (len(asked) == 2) == (per_call < harness.BLOCK_S / 8)


def test_every_block_starts_with_an_untimed_call():
    sweep = _bare_sweep()
    for iters in (1, 3):
        calls, res = [], _result("native", "in", 1e-3, rounds=())
        res.ranks_t = []
        sweep._block(lambda: calls.append(1), iters, res)
        assert len(calls) == iters + 1 and len(res.rounds) == 1 and res.iters == iters


def test_sweep_times_every_row_on_one_rank():
    """A real sweep on COMM_SELF: every algorithm and mode, checked exact, ``rounds`` times
    each, and ``auto``'s pick asked."""
    from mpi4py import MPI
    sweep = harness.Sweep(Allreduce(), MPI.COMM_SELF, algorithms=["native", "ring", "auto"],
                          rounds=3)
    res = sweep.run([8, 4096])
    assert {(r.algorithm, r.mode, r.nbytes) for r in res} == \
        {(a, m, s) for a in ("native", "ring", "auto") for m in ("out", "in") for s in (8, 4096)}
    assert all(r.wrong == 0 and len(r.rounds) == 3 and r.time > 0 for r in res)
    import collectives
    picks = [r.picked for r in res if r.algorithm == "auto"]
    assert len(picks) == 4 and set(picks) <= set(collectives.algorithms("allreduce")), picks


def test_gloo_runs_after_every_other_row(monkeypatch):
    """gloo's process group starts only after every other block of every size, and its blocks
    run then, in rounds of their own; the output gets each size's gloo rows after the rest."""
    from mpi4py import MPI
    real_calls, real_block = harness.Sweep._callables, harness.Sweep._block
    seen, shown = [], []

    def callables(self, coll, count, algorithms=None):
        if algorithms == ["gloo"]:  # native's calls, named gloo
            import collectives
            calls, cin = real_calls(self, collectives, count, ["native"])
            return {("gloo", mode): call for (_, mode), call in calls.items()}, cin
        return real_calls(self, coll, count, algorithms)

    def block(self, fn, iters, res):
        seen.append(res.algorithm)
        return real_block(self, fn, iters, res)

    def start(self):
        if self._gloo is None:
            seen.append("start")
            self._gloo = object()
        return self._gloo
    monkeypatch.setattr(harness.Sweep, "_callables", callables)
    monkeypatch.setattr(harness.Sweep, "_block", block)
    monkeypatch.setattr(harness.Sweep, "_start_gloo", start)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    sweep = harness.Sweep(Allreduce(), MPI.COMM_SELF, algorithms=["native", "ring", "gloo"],
                          rounds=3, modes=["out"],
                          out=lambda res, late=False: shown.append(
                              (late, sorted({r.algorithm for r in res}))))
    res = sweep.run([1 << 10, 1 << 12])
    first = seen.index("start")
    assert seen[first + 1:] == ["gloo"] * 6 and "gloo" not in seen[:first]
    assert len(seen[:first]) == 2 * 2 * 3  # native and ring, two sizes, 3 rounds
    gloo = [r for r in res if r.algorithm == "gloo"]
    assert [r.nbytes for r in gloo] == [1 << 10, 1 << 12]
    assert all(len(r.rounds) == 3 and r.wrong == 0 for r in gloo)
    assert shown == [(False, ["native", "ring"])] * 2 + [(True, ["gloo", "native", "ring"])] * 2


def test_gloo_is_skipped_with_a_note_for_a_dtype_it_has_no_kernel_for(monkeypatch):
    """gloo refuses some dtypes at its first call, on every rank (uint32: "Invalid scalar
    type"): the sweep leaves it out before it starts, with a note, and the other rows run."""
    from mpi4py import MPI
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    started = []
    monkeypatch.setattr(harness.Sweep, "_start_gloo", lambda self: started.append(1))
    for dtype, note in (("uint32", "gloo has no uint32, skipped"),
                        ("bool", "gloo has no bool, skipped")):
        sweep = harness.Sweep(Allreduce(), MPI.COMM_SELF, dtype=dtype,
                              op="bor" if dtype == "bool" else "sum",
                              algorithms=["native", "gloo"], rounds=2, modes=["out"])
        assert sweep.algorithms == ["native"] and sweep.notes == [note]
        res = sweep.run([1 << 10])
        assert [r.algorithm for r in res] == ["native"] and res[0].wrong == 0
    assert not started


# -- reports --------------------------------------------------------------------------------------
def test_table_has_every_column_and_ratio_to_native():
    res = [_result("native", "out", 2e-3), _result("native", "in", 2e-3),
           _result("ring", "out", 1e-3), _result("ring", "in", 4e-3, wrong=None),
           _result("gloo", "in", 8e-3)]
    text = report.format_table(res, ["out", "in"], latency=True, membw_Bps=1e9)
    head = text.splitlines()[:3]
    for col in ("size", "count", "type", "redop", "root", "algorithm", "time", "iqr%", "algbw",
                "busbw", "#wrong", "xnative", "%bound", "lat-min", "lat-avg", "lat-max"):
        assert col in head[1], col
    assert "out-of-place" in head[0] and "in-place" in head[0]
    rows = {ln.split()[5]: ln.split() for ln in text.splitlines()[3:]}
    assert set(rows) == {"native", "ring", "gloo"}
    assert rows["ring"][6] == "1000.00" and rows["native"][6] == "2000.00"  # time, us
    # the tail: xnative %bound (out of place), xnat-in %bnd-in
    assert "xnat-in" in head[1] and "%bnd-in" in head[1]
    assert rows["ring"][-4] == "2.00"          # twice as fast as native, out of place
    assert rows["ring"][-2] == "0.50"          # half as fast in place
    assert rows["native"][-4] == "1.00"
    assert "N/A" in rows["ring"]                # unchecked in place
    assert rows["gloo"][6] == "-"               # gloo has no out-of-place allreduce
    assert rows["gloo"][-4] == "-" and rows["gloo"][-2] == "0.25"
    # %bound: 2 n N bytes at 1 GB/s over the time
    assert float(rows["ring"][-3]) == pytest.approx(100 * 2 * 2 * 1024 / 1e9 / 1e-3, abs=0.1)
    foot = "\n".join(report.footer(res, ["out", "in"]))
    assert "Avg bus bandwidth" in foot and "ring" in foot


def test_auto_rows_and_footer_say_what_auto_ran():
    res = []
    for nbytes, pick in ((8, "native"), (64, "native"), (512, "ring"), (4096, "shm")):
        r = _result("auto", "out", 1e-3, nbytes=nbytes)
        r.picked = pick
        res.append(r)
    assert report.footer(res, ["out"])[-1] == "# auto ran: native (8 - 64), ring (512), shm (4K)"
    assert res[0].to_dict()["picked"] == "native"
    inplace = []
    for r in res:
        q = _result("auto", "in", 1e-3, nbytes=r.nbytes)
        q.picked = "native" if r.nbytes < 4096 else "shm"
        inplace.append(q)
    assert report.footer(res + inplace, ["out", "in"])[-2:] == \
        ["# auto ran: native (8 - 64), ring (512), shm (4K)",
         "# auto ran in place: native (8 - 512), shm (4K)"]
    names = [ln.split()[5] for ln in report.format_table(res + inplace, ["out", "in"])
             .splitlines()[3:]]
    assert names == ["auto:native", "auto:native", "auto:ring/native", "auto:shm"]
    assert report.label("auto", [None, None]) == "auto"
    assert report.label("ring", ["x"]) == "ring"


def test_json_and_csv(tmp_path):
    res = [_result("native", "out", 2e-3), _result("ring", "out", 1e-3)]
    report.write_json(tmp_path / "r.json", res, {"ranks": 2})
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["ranks"] == 2 and [r["algorithm"] for r in data["results"]] == ["native", "ring"]
    assert data["results"][1]["time_us"] == pytest.approx(1000)
    report.write_csv(tmp_path / "r.csv", res)
    lines = (tmp_path / "r.csv").read_text().splitlines()
    assert lines[0].startswith("collective,size,count") and len(lines) == 3
    assert "rounds_us" not in lines[0]


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


def test_every_bench_module_has_a_docstring_and_all_and_no_cycle():
    for path in sorted((ROOT / "bench").glob("*.py")):
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), path.name
        assert any(isinstance(node, (ast.Assign, ast.AnnAssign)) and "__all__" in
                   ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node.target)
                   for node in tree.body), path.name
    assert not (ROOT / "bench" / "verdict.py").exists()
    # plot and report stand without the timing loop (they had imported each other's modules)
    done = subprocess.run([sys.executable, "-c", "import sys, bench.plot, bench.report, "
                           "bench.stats; assert 'bench.harness' not in sys.modules, "
                           "sorted(m for m in sys.modules if m.startswith('bench'))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_output_paths_are_checked_before_the_sweep(tmp_path, monkeypatch):
    assert report.output_problem(str(tmp_path / "r.json")) is None
    assert "no folder" in report.output_problem(str(tmp_path / "missing" / "r.json"))
    assert "is a folder" in report.output_problem(str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert "needs matplotlib" in report.output_problem(str(tmp_path / "p.png"),
                                                      needs="matplotlib")

    class One:  # a communicator of one rank
        def Get_rank(self):
            return 0

        def bcast(self, obj, root=0):
            return obj
    report.check_outputs(One(), {"--json": str(tmp_path / "r.json"), "--csv": None})
    with pytest.raises(SystemExit, match=r"--plot .*p\.png: needs matplotlib"):
        report.check_outputs(One(), {"--plot": str(tmp_path / "p.png")})


def test_gloo_leaves_the_excepthook_alone():
    pytest.importorskip("torch")
    from mpi4py import MPI

    from bench import gloo

    def mine(*exc):
        return None
    old = sys.excepthook
    sys.excepthook = mine
    try:
        g = gloo.init(MPI.COMM_SELF)
        try:
            # torch's init_process_group wraps the hook in one that writes the traceback only
            # after the wrapped hook returns: an aborting hook would never print it
            assert sys.excepthook is mine
        finally:
            g.close()
    finally:
        sys.excepthook = old


# -- tune -----------------------------------------------------------------------------------------
def test_tune_rules_and_merge(tmp_path):
    # the last rule ends at the largest size measured: past it the built-in table applies
    assert tune.rules([(8, "native"), (32, "native"), (128, "ring"), (512, "ring")]) == \
        [[32, "native"], [512, "ring"]]
    assert tune.rules([(1024, "ring"), (8, "native")]) == [[8, "native"], [1024, "ring"]]
    assert tune.rules([(8, "a"), (16, "b"), (32, "a")]) == [[8, "a"], [16, "b"], [32, "a"]]
    assert tune.rules([]) == []
    path = tmp_path / "tuning.json"
    data, note = tune.merge(path, "sig", 2, {"allreduce": [[None, "ring"]]})
    assert note is None and data["tables"]["allreduce"] == {"2": [[None, "ring"]]}
    path.write_text(json.dumps(data))
    data, note = tune.merge(path, "sig", 3, {"allreduce": [[64, "native"], [None, "ring"]],
                                             "allreduce in-place": [[None, "shm"]]})
    assert set(data["tables"]["allreduce"]) == {"2", "3", "in-place"}
    assert data["tables"]["allreduce"]["in-place"] == {"3": [[None, "shm"]]}
    path.write_text(json.dumps(data))
    data, note = tune.merge(path, "other machine", 2, {"allreduce": [[None, "tree"]]})
    assert "another machine" in note and (tmp_path / "tuning.json.bak").exists()
    assert data["tables"] == {"allreduce": {"2": [[None, "tree"]]}}


def test_tune_keeps_the_incumbent_within_the_margin():
    row = [_result("native", "out", 1.00e-3), _result("ring", "out", 0.96e-3),
           _result("tree", "out", 0.90e-3, wrong=3)]
    # tree is fastest but wrong: out; ring beats native by 4%, inside the 5% margin
    assert tune.pick(row, "native").algorithm == "native"
    assert tune.pick(row, None).algorithm == "ring"
    assert tune.pick(row, "gone").algorithm == "ring"
    row[1] = _result("ring", "out", 0.94e-3)  # 6% faster: replaces the incumbent
    assert tune.pick(row, "native").algorithm == "ring"
    assert tune.pick(row, "native", margin=0.1).algorithm == "native"
    with pytest.raises(RuntimeError, match="exact"):
        tune.pick([_result("ring", "out", 1e-3, wrong=1)], "ring")


def test_tune_incumbent_is_the_built_in_tables_pick():
    from collectives import select
    table = select.DEFAULT_TABLE
    assert tune.builtin_pick("allreduce", 8, 2) == table["allreduce"]["2"][0][1]
    assert tune.builtin_pick("allreduce", 1 << 40, 2) == table["allreduce"]["2"][-1][1]
    assert tune.builtin_pick("allreduce", 1 << 40, 3, inplace=True) == \
        table["allreduce"]["in-place"]["3"][-1][1]
    # more ranks than any rule: the largest smaller size's rules
    assert tune.builtin_pick("allreduce", 1 << 40, 9) == table["allreduce"]["3"][-1][1]
    # reduce has no in-place rules: the others
    assert tune.builtin_pick("reduce", 1 << 40, 2, inplace=True) == table["reduce"]["2"][-1][1]


def test_tune_writes_where_it_is_told_without_reading_it(tmp_path, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_TUNING", str(tmp_path / "missing.json"))
    assert tune.output_path() == tmp_path / "missing.json"
    assert tune.output_path(str(tmp_path / "o.json")) == tmp_path / "o.json"
    monkeypatch.delenv("COLLECTIVES_TUNING")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tune.output_path() == tmp_path / "collectives" / "tuning.json"


def test_a_tuning_file_governs_only_the_sizes_it_measured(tmp_path):
    from collectives import config, select
    measured = 256 << 10  # a `tune -e 256K` run: every rule ends at or below 256 KiB
    table = {"allreduce": tune.rules([(8, "native"), (measured, "ring")]),
             "allreduce in-place": tune.rules([(8, "native"), (measured, "shm")])}
    assert table["allreduce in-place"][-1] == [measured, "shm"]
    data, _ = tune.merge(tmp_path / "t.json", "sig", 2, table)
    (tmp_path / "t.json").write_text(json.dumps(data))
    old = config.set("COLLECTIVES_TUNING", str(tmp_path / "t.json"))
    try:
        assert select.auto("allreduce", measured, 2, inplace=True) == "shm"
        assert select.auto("allreduce", measured, 2) == "ring"
        for nbytes in (measured + 4, 8 << 20, 1 << 30):
            for inplace in (False, True):
                assert select.auto("allreduce", nbytes, 2, inplace=inplace) == \
                    tune.builtin_pick("allreduce", nbytes, 2, inplace), (nbytes, inplace)
        # a hand-written file's null limit still means every size
        (tmp_path / "hand.json").write_text(json.dumps(
            {"version": 1, "tables": {"allreduce": {"2": [[None, "tree"]]}}}))
        config.set("COLLECTIVES_TUNING", str(tmp_path / "hand.json"))
        assert select.auto("allreduce", 1 << 30, 2) == "tree"
    finally:
        config.set("COLLECTIVES_TUNING", old)


def test_tuning_file_is_what_select_reads(tmp_path):
    from collectives import config, select
    data, _ = tune.merge(tmp_path / "t.json", "sig", 2,
                         {"allreduce": [[100, "native"], [None, "tree"]],
                          "allreduce in-place": [[1000, "native"], [None, "ring"]],
                          "reduce": [[None, "binomial"]]})
    (tmp_path / "t.json").write_text(json.dumps(data))
    old = config.set("COLLECTIVES_TUNING", str(tmp_path / "t.json"))
    try:
        assert select.auto("allreduce", 64, 2) == "native"
        assert select.auto("allreduce", 1000, 2) == "tree"
        assert select.auto("allreduce", 1000, 2, inplace=True) == "native"
        assert select.auto("allreduce", 4096, 2, inplace=True) == "ring"
        assert select.auto("reduce", 4096, 2) == "binomial"
    finally:
        config.set("COLLECTIVES_TUNING", old)


# -- overhead -------------------------------------------------------------------------------------
def test_overhead_table_on_fixed_rows():
    rows = [{"size": 8, "mode": "out", "row": row, "call": overhead.ROWS[row],
             "picked": "native" if row == "auto" else None, "time": t, "spread": 0.02,
             "over_bare": t - 2e-6} for row, t in (("bare", 2e-6), ("native", 5.5e-6),
                                                    ("auto", 6e-6))]
    text = overhead.format_table(rows, {"ranks": 2, "host": "h", "mpi": "MPICH", "rounds": 9,
                                        "calls": 500})
    lines = text.splitlines()
    assert "| size | mode | call | time (µs) | spread | API - bare (µs) |" in lines
    body = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[4:]]
    assert body == [["8", "out", "mpi4py comm.Allreduce", "2.00", "2.0%", ""],
                    ["8", "out", 'coll.allreduce(algorithm="native")', "5.50", "2.0%", "+3.50"],
                    ["8", "out", 'coll.allreduce(algorithm="auto") → native', "6.00", "2.0%",
                     "+4.00"]]


@pytest.mark.mpi
def test_overhead_under_mpi(tmp_path):
    """A short ``bench overhead``: every row at every size and mode, positive times, the gap
    to the bare call computed from the medians, and the same figures on every rank."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rows = overhead.measure(comm, sizes=(8, 4096), rounds=3, calls=20,
                            rows=tuple(overhead.ROWS))
    assert [(r["size"], r["mode"], r["row"]) for r in rows] == \
        [(s, m, row) for s in (8, 4096) for m in ("out", "in") for row in overhead.ROWS]
    assert all(r["time"] > 0 and len(r["rounds"]) == 3 for r in rows)
    for r in rows:
        bare = next(q for q in rows if (q["size"], q["mode"], q["row"]) ==
                    (r["size"], r["mode"], "bare"))
        assert r["over_bare"] == pytest.approx(r["time"] - bare["time"])
    assert all(r["picked"] for r in rows if r["row"] == "auto")
    assert comm.allgather([r["time"] for r in rows]) == [[r["time"] for r in rows]] * \
        comm.Get_size()
    out = tmp_path / "o.json"
    assert overhead.main(["--sizes", "8,64K", "--rounds", "2", "--calls", "10",
                          "--json", str(out)]) == 0
    if comm.Get_rank() == 0:
        data = json.loads(out.read_text())
        assert data["ranks"] == comm.Get_size() and len(data["rows"]) == 2 * 2 * 3
        assert {r["size"] for r in data["rows"]} == {8, 64 << 10}


@pytest.mark.mpi
def test_overhead_of_every_collective_under_mpi():
    """``bench overhead --collectives``: every collective, every kind of call that applies to it
    (a row pair each: bare and API), the gap computed from the medians, the same figures on
    every rank, and the persistent requests freed (none left for MPI_Finalize)."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rows = overhead.measure_collectives(comm, rounds=2, calls=5)
    pairs = {(r["collective"], r["kind"]) for r in rows}
    kinds = {c: {k for c2, k in pairs if c2 == c} for c in overhead.COLLECTIVES}
    assert len(rows) == 2 * len(pairs)
    assert all({"same", "persistent"} <= kinds[c] for c in overhead.COLLECTIVES)
    assert {"fresh", "no out"} <= kinds["allreduce"] and {"list", "learned"} <= kinds["allgather"]
    for r in rows:
        bare = next(q for q in rows if (q["collective"], q["kind"], q["row"]) ==
                    (r["collective"], r["kind"], "bare"))
        assert r["time"] > 0 and r["over_bare"] == pytest.approx(r["time"] - bare["time"])
    assert comm.allgather([r["time"] for r in rows]) == [[r["time"] for r in rows]] * \
        comm.Get_size()
    text = overhead.format_collectives(rows, {"ranks": comm.Get_size(), "host": "h",
                                              "mpi": "MPICH", "rounds": 2, "calls": 5})
    assert "| allreduce | 8 | persistent | comm.Allreduce_init |" in text
    assert "- learned: " in text


# -- the command line -----------------------------------------------------------------------------
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
    assert entry.main([]) == 0
    out = capsys.readouterr().out
    assert "commands" in out and "overhead" in out and "verdict" not in out
    assert entry.main(["nope"]) == 2
    assert entry.main(["verdict"]) == 2
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


def test_readme_table_of_auto_is_the_built_in_table():
    """The README's table of what ``auto`` runs is ``select.DEFAULT_TABLE`` in words."""
    from collectives import select
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("| collective | n = 2 | n = 3 and more |") + 2
    readme = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        names, two, three = (cell.strip() for cell in line.strip("|").split("|"))
        for name in names.split(", "):  # collectives with the same rules share a row
            readme[name] = (two, three)
    table = select.DEFAULT_TABLE
    expected = {c: (select.describe(table[c]["2"]), select.describe(table[c]["3"]))
                for c in select.COLLECTIVES}
    expected["allreduce in place"] = tuple(select.describe(table["allreduce"]["in-place"][n])
                                           for n in ("2", "3"))
    assert readme == expected
    assert select.describe([[32 << 10, "native"], [None, "ring"]]) == "native ≤ 32 KiB, ring"


def test_bench_runs_outside_the_checkout(tmp_path):
    """``bench`` installs with the package: ``python -m bench`` from another directory."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "bench", "model", "--ranks", "8",
                           "--ranks-per-node", "4", "--bytes", "1M"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "# fastest:" in done.stdout


# -- under mpiexec --------------------------------------------------------------------------------
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
    p = _run(["allreduce", "-b", "8", "-e", "40K", "-f", "8", "--rounds", "2",
              "--json", str(out)])
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [ln.split() for ln in p.stdout.splitlines() if ln and not ln.startswith("#")]
    registered = set(collectives.algorithms("allreduce"))
    assert registered <= {r[5] for r in rows}
    assert any(r[5].startswith("auto:") for r in rows)
    data = json.loads(out.read_text())
    assert {r["size"] for r in data["results"]} == {8, 64, 512, 4096, 32768, 40960}
    assert registered | {"auto"} <= {r["algorithm"] for r in data["results"]}
    assert all(r["wrong"] == 0 for r in data["results"]), \
        [r for r in data["results"] if r["wrong"]]
    assert all(r["time_us"] > 0 and len(r["rounds_us"]) == 2 for r in data["results"])
    assert "# Avg bus bandwidth" in p.stdout and "memory bandwidth" in p.stdout
    # the pick is the table's: every auto row names a registered algorithm
    picked = [r["picked"] for r in data["results"] if r["algorithm"] == "auto"]
    assert len(picked) == 12 and set(picked) <= registered, picked
    assert "# auto ran: " in p.stdout


@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec")
def test_an_unwritable_output_is_refused_on_every_rank_before_the_sweep(tmp_path):
    p = _run(["allreduce", "-b", "8", "-e", "8", "--rounds", "1", "--json",
              str(tmp_path / "missing" / "r.json")], timeout=60)
    assert p.returncode != 0
    for rank in (0, 1):
        assert f"rank {rank}: cannot write --json" in p.stderr, p.stderr
    assert "size" not in p.stdout, p.stdout  # nothing was measured


@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec")
def test_tune_under_mpiexec_writes_a_table_auto_reads(tmp_path):
    from collectives import config, select
    path = tmp_path / "tuning.json"
    rows = tmp_path / "rows.json"
    # COLLECTIVES_TUNING names the file tune is about to create: tune must not read it
    p = _run(["tune", "--collectives", "allreduce,broadcast", "-b", "8", "-e", "4K", "-f", "16",
              "--rounds", "2", "--json", str(rows)], env={"COLLECTIVES_TUNING": str(path)})
    assert p.returncode == 0, p.stdout + p.stderr
    got = json.loads(rows.read_text())
    assert got["tune"] and got["ranks"] == 2
    seen = {(r["collective"], r["algorithm"], r["size"], r["mode"]) for r in got["results"]}
    import collectives
    for c, modes in (("allreduce", ("out", "in")), ("broadcast", ("in",))):
        # every algorithm a table may name (not those on registered buffers only)
        named = [a for a in collectives.algorithms(c) if not select.get(c, a).registered]
        assert {(c, a, s, m) for a in named for s in (8, 128, 2048, 4096)
                for m in modes} <= seen
    assert all(r["time_us"] > 0 and r["wrong"] == 0 for r in got["results"])
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["signature"]
    tables = data["tables"]
    for table in (tables["allreduce"]["2"], tables["broadcast"]["2"],
                  tables["allreduce"]["in-place"]["2"]):
        assert table[-1][0] == 4096  # the largest size measured
        assert all(len(rule) == 2 and rule[1] in collectives.algorithms("allreduce") +
                   collectives.algorithms("broadcast") for rule in table)
    assert "in-place" not in tables["broadcast"]
    assert "# allreduce: " in p.stdout and "# allreduce in-place: " in p.stdout
    # the run says how the next job reads the table, and that past 4K the built-in one applies
    assert f"# auto reads {path} while COLLECTIVES_TUNING={path}" in p.stdout, p.stdout
    assert "past 4K: the built-in table" in p.stdout, p.stdout
    old = config.set("COLLECTIVES_TUNING", str(path))
    try:
        for limit, name in tables["allreduce"]["2"]:
            assert select.auto("allreduce", limit, 2) == name
        assert select.auto("allreduce", 8 << 20, 2) == tune.builtin_pick("allreduce", 8 << 20, 2)
    finally:
        config.set("COLLECTIVES_TUNING", old)


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_bench_elastic_prints_every_variant(capsys):
    """A short ``bench elastic``: a row per variant, each checkpoint interval writing
    rounds x steps / K checkpoints on every rank (the count rank 0 prints), and the temporary
    directory removed."""
    import glob
    import tempfile

    from mpi4py import MPI

    from bench import elastic
    pytest.importorskip("torch")
    comm = MPI.COMM_WORLD
    before = set(glob.glob(f"{tempfile.gettempdir()}/bench-elastic-*"))
    assert elastic.main(["--params-m", "0.5", "--rounds", "2", "--steps", "3",
                         "--every", "2,4"]) == 0
    out = capsys.readouterr().out
    comm.Barrier()
    if comm.Get_rank() == 0:
        rows = {ln.split()[0] + (" " + ln.split()[1] if ln.split()[0] == "checkpoint" else ""):
                ln.split() for ln in out.splitlines() if ln.startswith("  ")}
        assert set(rows) == {"plain", "commit", "checkpoint 2", "checkpoint 4"}, out
        assert "4 steps a variant" in out                 # 3 rounded up to lcm(2, 4)
        assert rows["checkpoint 2"][-1] == "4" and rows["checkpoint 4"][-1] == "2", out
        assert set(glob.glob(f"{tempfile.gettempdir()}/bench-elastic-*")) == before
