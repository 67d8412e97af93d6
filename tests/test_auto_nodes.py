"""What ``auto`` picks where ranks span nodes: the table's multi-node rules for nodes of several
ranks, the other rules (and the single-node swap) where every node holds one rank, and a tuning
file's multi-node rules over the built-in ones; ``bench tune`` stores its rules there."""
from __future__ import annotations

import json

import pytest

from bench import tune
from collectives import config, select

MIB = 1 << 20


def called(value):
    """A flag callable that records that it was asked."""
    asked = []

    def flag():
        asked.append(True)
        return value
    flag.asked = asked
    return flag


@pytest.mark.parametrize("size", [4, 6, 16])
def test_nodes_of_several_ranks_take_the_multi_node_rules(size):
    for collective in ("allreduce", "reduce_scatter", "allgather"):
        rules = select.DEFAULT_TABLE[collective][select.MULTI]["default"]
        for limit, name in rules:
            nbytes = 16 * MIB if limit is None else limit
            assert select.auto(collective, nbytes, size, single_node=False, alone=False) == name
            # in place too: the multi-node rules hold for both
            assert select.auto(collective, nbytes, size, False, True, False) == name
    assert select.auto("allreduce", 16 * MIB, size, False, alone=False) == "hierarchical"
    assert select.auto("allreduce", 8, size, False, alone=False) == "native"


def test_one_node_and_one_rank_a_node_keep_the_other_rules():
    one = called(True)
    assert select.auto("allreduce", 16 * MIB, 4, one) == \
        select.rule(select.DEFAULT_TABLE, "allreduce", 16 * MIB, 4)
    assert one.asked
    # Every node one rank: a flat network; the rules of one node, shm swapped for its part
    # across nodes (ring), as before there were multi-node rules.
    for nbytes in (8, 1 * MIB, 16 * MIB):
        plain = select.rule(select.DEFAULT_TABLE, "allreduce", nbytes, 4)
        want = {"shm": "ring"}.get(plain, plain)
        assert select.auto("allreduce", nbytes, 4, single_node=False, alone=True) == want


def test_the_topology_is_asked_only_where_it_matters():
    spans, alone = called(False), called(False)
    # gather has no multi-node rules and its rules name no single-node algorithm
    assert select.auto("gather", 1 * MIB, 4, spans, alone=alone) == "native"
    assert not spans.asked and not alone.asked
    # one rank: never spans nodes
    assert select.auto("allreduce", 16 * MIB, 1, spans, alone=alone) in select.algorithms(
        "allreduce")
    assert not spans.asked


def test_a_tuning_file_overrides_the_multi_node_rules(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"version": 1, "tables": {"allreduce": {
        select.MULTI: {"4": [[1 * MIB, "ring"]]}}}}))
    monkeypatch.setenv("COLLECTIVES_TUNING", str(path))
    config.reload()
    try:
        assert select.auto("allreduce", 1 * MIB, 4, False, alone=False) == "ring"
        assert select.auto("allreduce", 1 * MIB, 6, False, alone=False) == "ring"  # nearest
        # past the file's sizes: the built-in multi-node rules
        assert select.auto("allreduce", 16 * MIB, 4, False, alone=False) == "hierarchical"
        # a file's multi-node rule that names shm: its hierarchical counterpart
        path.write_text(json.dumps({"version": 1, "tables": {"reduce_scatter": {
            select.MULTI: {"default": [[None, "shm"]]}}}}))
        config.reload()
        assert select.auto("reduce_scatter", 1 * MIB, 4, False, alone=False) == "hierarchical"
    finally:
        monkeypatch.delenv("COLLECTIVES_TUNING")
        config.reload()


def test_tune_stores_multi_node_rules_beside_the_others(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"version": 1, "signature": "s", "tables": {
        "allreduce": {"4": [[None, "ring"]]}}}))
    data, note = tune.merge(path, "s", 4, {f"allreduce {select.MULTI}": [[None, "hierarchical"]],
                                           "allreduce in-place": [[None, "ring"]]})
    assert note is None
    assert data["tables"]["allreduce"] == {"4": [[None, "ring"]],
                                           select.MULTI: {"4": [[None, "hierarchical"]]},
                                           "in-place": {"4": [[None, "ring"]]}}
    assert tune.builtin_pick("allreduce", 16 * MIB, 4, multi_node=True) == "hierarchical"
    assert tune._modes("allreduce", ["out", "in"], in_place=False) == ["out"]
    assert tune._modes("allreduce", ["out", "in"]) == ["out", "in"]
