"""data/batching.py: budgets, permutations, resume from g, rank split. Pure Python, < 1 s."""
import numpy as np
import pytest

from data.batching import BatchPlan

RNG = np.random.default_rng(0)
LENGTHS = np.concatenate([RNG.integers(5, 200, 700), RNG.integers(200, 1024, 300)]).tolist()
BUDGET, MAX_BS = 4096, 16


def check_budget(plan, batches):
    for b in batches:
        assert 1 <= len(b) <= MAX_BS
        assert len(b) * max(LENGTHS[i] for i in b) <= BUDGET


@pytest.mark.parametrize("shuffle_members", [0, 4])
def test_budget_and_permutation(shuffle_members):
    plan = BatchPlan(LENGTHS, BUDGET, MAX_BS, seed=3, shuffle_members=shuffle_members)
    orders = []
    for e in range(3):
        batches = plan.epoch(e)
        assert len(batches) == plan.num_batches
        check_budget(plan, batches)
        flat = sorted(i for b in batches for i in b)
        assert flat == list(range(len(LENGTHS)))  # every sequence exactly once per epoch
        orders.append([tuple(b) for b in batches])
    assert orders[0] != orders[1] != orders[2]
    again = BatchPlan(LENGTHS, BUDGET, MAX_BS, seed=3, shuffle_members=shuffle_members)
    assert [tuple(b) for b in again.epoch(1)] == orders[1]  # deterministic from (seed, epoch)
    assert [tuple(b) for b in BatchPlan(LENGTHS, BUDGET, MAX_BS, seed=4).epoch(1)] != orders[1]
    members = [frozenset(map(frozenset, o)) for o in orders]
    assert (members[0] == members[1]) == (shuffle_members == 0)  # membership re-dealt only when asked


def test_padding_waste_low():
    plan = BatchPlan(LENGTHS, BUDGET, MAX_BS, seed=0)
    st = plan.stats()
    assert st["sequences"] == len(LENGTHS) and st["tokens"] == sum(LENGTHS)
    assert 0 <= st["padding_waste"] < 0.05  # sorted buckets: little padding
    assert plan.padding_waste(2) == pytest.approx(plan.padding_waste())  # same batches, other order
    assert BatchPlan(LENGTHS, BUDGET, MAX_BS, shuffle_members=8).padding_waste(1) < 0.15


def test_resume_mid_epoch_and_ranks():
    plan = BatchPlan(LENGTHS, BUDGET, MAX_BS, seed=7)
    n = plan.num_batches
    g = n + n // 3  # stopped a third into epoch 1
    assert plan.position(g) == (1, n // 3)
    fresh = BatchPlan(LENGTHS, BUDGET, MAX_BS, seed=7)  # a restarted process knows only g
    resumed = [b for _, b in fresh.batches_from(g, stop=2 * n + 5)]
    assert resumed == plan.epoch(1)[n // 3:] + plan.epoch(2)[:5]
    assert fresh.batch(g) == plan.epoch(1)[n // 3]
    # target rank r produces g with g % R == r: together the ranks cover every g once, each in increasing order
    R = 3
    per_rank = [list(fresh.batches_from(g, r, R, stop=g + 20)) for r in range(R)]
    gs = sorted(gg for pr in per_rank for gg, _ in pr)
    assert gs == list(range(g, g + 20))
    assert all(gg % R == r for r, pr in enumerate(per_rank) for gg, _ in pr)
    assert all(b == fresh.batch(gg) for pr in per_rank for gg, b in pr)
    assert plan.fingerprint() == fresh.fingerprint() != BatchPlan(LENGTHS, BUDGET, MAX_BS, seed=8).fingerprint()


def test_overlong():
    lengths = [10, 5000, 20, 9000]
    with pytest.raises(ValueError, match="2 of 4 sequences are longer than token_budget=4096"):
        BatchPlan(lengths, 4096, 8)
    plan = BatchPlan(lengths, 4096, 8, drop_overlong=True)
    assert plan.dropped == [1, 3] and plan.stats()["dropped"] == 2
    assert sorted(i for b in plan.epoch(0) for i in b) == [0, 2]


def test_max_batch_size_and_single():
    plan = BatchPlan([3] * 100, 10_000, 8)
    assert plan.num_batches == 13 and max(len(b) for b in plan.epoch(0)) == 8
    assert BatchPlan([4096], 4096, 8).epoch(5) == [[0]]
