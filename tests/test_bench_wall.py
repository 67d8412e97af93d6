"""``python -m bench wall``: a tiny study end to end (in-process tier: the test process is the
launcher, the jobs run on shared memory with ``--no-network``; skipped under mpiexec), the
summary's arithmetic on made-up runs, and the refusal without a network."""
import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from bench import wall  # noqa: E402

MPIEXEC = Path(sys.executable).parent / "mpiexec"
UNDER_MPI = any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"))


@pytest.mark.timeout(300)
def test_tiny_study_writes_the_table_json_and_plot(tmp_path, capsys, monkeypatch):
    if UNDER_MPI:
        pytest.skip("launches its own mpiexec jobs: run the test without mpiexec")
    if not MPIEXEC.exists():
        pytest.skip("mpiexec not found beside the interpreter")
    for k in [k for k in os.environ if k.startswith("COLLECTIVES_")]:
        monkeypatch.delenv(k)
    out, png = tmp_path / "wall.json", tmp_path / "wall.png"
    code = wall.main(["--no-network", "-n", "2", "--rounds", "2", "--methods",
                      "ddp,periodic-8", "--steps", "16", "--warmup", "4", "--width", "16",
                      "--batch", "8", "--samples", "512", "--test", "128", "--target", "0.99",
                      "--json", str(out), "--plot", str(png), "--timeout", "240"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "| ddp |" in printed and "| periodic-8 |" in printed, printed
    data = json.loads(out.read_text())
    runs, rows = data["runs"], {r["method"]: r for r in data["rows"]}
    # two rounds, the order rotated: ddp first, then periodic-8 first
    assert [(r["round"], r["method"]) for r in runs] == \
        [(0, "ddp"), (0, "periodic-8"), (1, "periodic-8"), (1, "ddp")]
    for r in runs:
        assert 0.0 <= r["final_accuracy"] <= 1.0
        steps = [c[0] for c in r["curve"]]
        times = [c[1] for c in r["curve"]]
        assert steps == sorted(steps) and times == sorted(times) and times[0] > 0, r["curve"]
        assert all(0.0 <= c[2] <= 1.0 for c in r["curve"])
        assert r["steps"] >= 16 and r["payload_bytes_per_step"] > 0
        assert r["loopback_bytes_per_step"] is None  # no namespace: lo is not the job's own
    # ddp evaluates every 8 steps; periodic-8 after its 4 warm-up steps only where the ranks
    # have just averaged: 8 steps after the warm-up, then the first such step from the cap
    assert [c[0] for c in runs[0]["curve"]] == [8, 16]
    assert [c[0] for c in runs[1]["curve"]] == [12, 20]
    # the bucket's gradients every step against the model every 8 steps after 4
    assert rows["periodic-8"]["payload_bytes_per_step"] < \
        rows["ddp"]["payload_bytes_per_step"] / 2
    assert rows["ddp"]["fewer_bytes"] == 1.0
    assert png.stat().st_size > 0


def test_evaluation_points_follow_the_averaging():
    m = wall._Method("periodic-8", None, None, None, sync_every=8, warmup=4)
    assert [s for s in range(1, 30) if m.evaluates(s, 8, 1000)] == [12, 20, 28]
    assert [s for s in range(1, 30) if m.evaluates(s, 2, 1000)] == [2, 4, 12, 20, 28]
    d = wall._Method("diloco-32", None, None, None, sync_every=32)
    assert [s for s in range(1, 100) if d.evaluates(s, 8, 1000)] == [32, 64, 96]
    assert [s for s in range(1, 100) if d.evaluates(s, 8, 40)] == [32, 64, 96]
    p = wall._Method("ddp", None, None, None)
    assert [s for s in range(1, 20) if p.evaluates(s, 8, 12)] == [8, 12, 13, 14, 15, 16, 17,
                                                                   18, 19]


def _run(method, time_s, acc, payload, rnd=0):
    return {"method": method, "round": rnd, "reached": time_s is not None,
            "steps_to_target": None if time_s is None else 10 * time_s,
            "time_to_target_s": time_s, "train_s": time_s or 99.0, "final_accuracy": acc,
            "ms_per_step": 100.0, "payload_bytes_per_step": payload,
            "loopback_bytes_per_step": None, "curve": [[8, 1.0, acc]]}


def test_summary_medians_spread_and_ratios():
    runs = [_run("ddp", t, 0.96, 4e6, i) for i, t in enumerate((10.0, 12.0, 11.0))]
    runs += [_run("periodic-8", t, 0.955, 5e5, i) for i, t in enumerate((4.0, 6.0, 5.0))]
    runs += [_run("topk", t, 0.95, 8e4, i) for i, t in enumerate((9.0, None, 7.0))]
    runs += [_run("diloco-32", None, 0.9, 1e5, i) for i in range(3)]
    rows = {r["method"]: r for r in wall.summarise(runs, wall.METHODS)}
    assert list(rows) == ["ddp", "topk", "periodic-8", "diloco-32"]
    ddp, per, topk, dil = rows["ddp"], rows["periodic-8"], rows["topk"], rows["diloco-32"]
    assert (ddp["time_to_target_s"], ddp["time_min_s"], ddp["time_max_s"]) == (11.0, 10.0, 12.0)
    assert per["vs_ddp"] == pytest.approx(5.0 / 11.0) and per["fewer_bytes"] == 8.0
    assert topk["reached"] == 2 and topk["time_to_target_s"] == 8.0
    assert dil["time_to_target_s"] is None and dil["vs_ddp"] is None
    assert topk["vs_ddp"] == pytest.approx(8.0 / 11.0)
    assert per["final_accuracy"] == 0.955 and dil["reached"] == 0
    table = "\n".join(wall._table(list(rows.values())))
    assert "| diloco-32 | - | not reached (0/3) |" in table
    assert "8.0 [7.0-9.0] (2/3 reached)" in table


def test_refuses_without_a_network(monkeypatch, capsys):
    import bench.net
    monkeypatch.setattr(bench.net, "check_available", lambda: "not root (uid 1000)")
    assert wall.main(["--rounds", "1"]) == 2
    assert "not root (uid 1000)" in capsys.readouterr().err


def test_unknown_method_is_refused():
    with pytest.raises(SystemExit, match="unknown method"):
        wall.main(["--no-network", "--methods", "ddp,nope"])
