"""Finding a rank's processes: its pid and every descendant, from one scan of procfs."""

from __future__ import annotations

import os

from sidecar.collectors import ranktree


def test_descendants_include_grandchildren_and_survive_loops():
    children = {10: [11, 12], 11: [13], 13: [10], 99: [100]}
    assert sorted(ranktree.descendant_pids(10, children)) == [11, 12, 13]
    assert ranktree.descendant_pids(12, children) == []


def test_the_scan_sees_this_process_under_its_parent():
    assert os.getpid() in ranktree.children_map()[os.getppid()]


def test_pid_owners_maps_each_rank_tree_and_skips_gone_ranks(rank_process):
    proc, child_pid = rank_process()
    owners = ranktree.pid_owners([("run-42", 3, proc.pid), ("run-42", 4, 999_999_999)])
    assert owners == {proc.pid: ("run-42", 3), child_pid: ("run-42", 3)}


def test_pid_zero_is_never_a_rank():
    assert ranktree.tree_pids(0) is None and ranktree.pid_owners([("run-42", 0, 0)]) == {}
