"""Tests of the multi-process harness `seqpar.testing` (fast: spawns a handful of pools)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from seqpar.testing import DistributedTimeout, RankError, get_pool, run_distributed

GRACE = 1.0  # failure grace used by the failure tests (the default of 5 s would slow CI)
SLACK = 15.0  # allowance for a loaded 2-core CI machine on top of the expected durations


# -- functions run on the ranks (module level, so they pickle by reference)


def _rank_info(tag, *, scale=1):
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "tag": tag * scale,
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
        "env": (os.environ["MASTER_ADDR"], os.environ["OMP_NUM_THREADS"], os.environ["RANK"]),
    }


def _all_reduce(base):
    t = base * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t


def _raise_everywhere():
    raise ValueError(f"block_size must divide T_local (rank {dist.get_rank()})")


def _raise_mixed():
    raise (ValueError if dist.get_rank() == 0 else KeyError)("mixed")


class _TwoArgError(Exception):
    def __init__(self, code, detail):
        super().__init__(f"code {code}: {detail}")


def _raise_two_arg_error():
    raise _TwoArgError(7, "needs two arguments")


def _subgroup_sum():
    group = dist.new_group([0, 1])
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return t.item(), len(dist.distributed_c10d._world.pg_map)


def _raise_on_rank_1_while_rank_0_blocks():
    if dist.get_rank() == 1:
        raise ValueError("rank one has a bad shape")
    t = torch.ones(4)
    dist.all_reduce(t)  # never completes: rank 1 is gone from the collective
    return t


def _hang_on_rank_1():
    if dist.get_rank() == 1:
        time.sleep(600)
    return dist.get_rank()


def _exit_on_rank_1():
    if dist.get_rank() == 1:
        os._exit(3)
    t = torch.ones(1)
    dist.all_reduce(t)  # fails or blocks: the peer process is gone
    return t


@pytest.fixture
def short_grace(monkeypatch):
    monkeypatch.setattr(get_pool(2), "failure_grace", GRACE)


def _pids(world_size):
    return [r["pid"] for r in run_distributed(_rank_info, world_size, "pid")]


# -- tests


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_per_rank(world_size):
    out = run_distributed(_rank_info, world_size, "ab", scale=2)
    assert [r["rank"] for r in out] == list(range(world_size))
    for rank, r in enumerate(out):
        assert r["world"] == world_size
        assert r["backend"] == "gloo"
        assert r["tag"] == "abab"
        assert r["threads"] == 1
        assert r["env"] == ("127.0.0.1", "1", str(rank))
    assert len({r["pid"] for r in out} | {os.getpid()}) == world_size + 1


def test_all_reduce():
    out = run_distributed(_all_reduce, 4, torch.arange(3.0))
    for t in out:
        torch.testing.assert_close(t, torch.arange(3.0) * 10)


def test_pool_is_reused():
    first = _pids(2)
    assert _pids(2) == first
    assert get_pool(2).pids == first


def test_value_error_on_every_rank_keeps_its_type():
    before = _pids(2)
    with pytest.raises(ValueError, match=r"block_size must divide T_local") as info:
        run_distributed(_raise_everywhere, 2)
    message = str(info.value)
    assert "(rank 0) (raised on ranks [0, 1])" in message
    assert "Traceback" in message and "_raise_everywhere" in message
    assert sorted(info.value.per_rank_errors) == [0, 1]
    type_name, text, tb = info.value.per_rank_errors[1]
    assert type_name == "ValueError" and "(rank 1)" in text and "_raise_everywhere" in tb
    assert _pids(2) == before  # every rank answered: the pool is kept


def test_mixed_exception_types_give_rank_error():
    with pytest.raises(RankError, match=r"rank 0: ValueError: mixed") as info:
        run_distributed(_raise_mixed, 2)
    assert info.value.ranks == [0, 1] and info.value.stuck_ranks == []
    assert info.value.per_rank_errors[1][0] == "KeyError"


def test_exception_not_constructible_from_a_message_gives_rank_error():
    with pytest.raises(RankError, match=r"code 7: needs two arguments") as info:
        run_distributed(_raise_two_arg_error, 2)
    assert info.value.ranks == [0, 1]


def test_subgroups_made_by_a_case_are_destroyed():
    first = run_distributed(_subgroup_sum, 2)
    assert run_distributed(_subgroup_sum, 2) == first == [(2.0, 2), (2.0, 2)]


def test_one_rank_raising_while_others_block(short_grace):
    before = _pids(2)
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1: ValueError: rank one has a bad shape") as info:
        run_distributed(_raise_on_rank_1_while_rank_0_blocks, 2, timeout=60)
    assert time.monotonic() - start < GRACE + SLACK
    assert info.value.ranks == [1] and info.value.stuck_ranks == [0]
    assert "_raise_on_rank_1_while_rank_0_blocks" in info.value.per_rank_errors[1][2]
    after = _pids(2)  # a fresh pool
    assert set(after).isdisjoint(before)
    assert [t.item() for t in run_distributed(_all_reduce, 2, torch.ones(1))] == [3.0, 3.0]


def test_hanging_rank_times_out():
    start = time.monotonic()
    with pytest.raises(DistributedTimeout, match=r"rank\(s\) \[1\]") as info:
        run_distributed(_hang_on_rank_1, 2, timeout=3)
    assert 3 <= time.monotonic() - start < 3 + SLACK
    assert isinstance(info.value, TimeoutError) and info.value.ranks == [1]
    assert [t.item() for t in run_distributed(_all_reduce, 2, torch.ones(1))] == [3.0, 3.0]


def test_rank_that_exits_is_reported(short_grace):
    with pytest.raises(RankError, match=r"rank 1 \(pid \d+\) exited with code 3") as info:
        run_distributed(_exit_on_rank_1, 2, timeout=60)
    assert 1 in info.value.ranks
    assert info.value.per_rank_errors[1][0] == "WorkerDied"
    assert [r["rank"] for r in run_distributed(_rank_info, 2, "x")] == [0, 1]
