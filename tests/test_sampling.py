"""Task sampling: exact probabilities, empirical frequencies, the annealing schedule, round robin, resuming."""

import copy
import math
from collections import Counter

import numpy as np
import pytest

from fastpals.data.sampling import (
    SAMPLING_METHODS,
    TaskSampler,
    annealed_alpha,
    round_robin_order,
    task_probabilities,
)

SIZES = [8544, 18187, 6040]


def test_alpha_schedule():
    assert annealed_alpha(1, 1) == 1.0
    assert annealed_alpha(1, 5) == 1.0
    assert annealed_alpha(5, 5) == pytest.approx(0.2)
    assert annealed_alpha(3, 5) == pytest.approx(0.6)
    assert [annealed_alpha(e, 3) for e in (1, 2, 3)] == pytest.approx([1.0, 0.6, 0.2])
    for bad in (0, 6):
        with pytest.raises(ValueError, match="epoch"):
            annealed_alpha(bad, 5)


def test_exact_probabilities():
    n = np.array(SIZES, dtype=np.float64)
    np.testing.assert_allclose(task_probabilities(SIZES, "proportional"), n / n.sum(), rtol=1e-15)
    np.testing.assert_allclose(task_probabilities(SIZES, "uniform"), [1 / 3] * 3, rtol=1e-15)
    np.testing.assert_allclose(task_probabilities(SIZES, "sqrt"), np.sqrt(n) / np.sqrt(n).sum(), rtol=1e-15)
    # annealed, epoch 2 of 3: alpha = 0.6
    expected = n**0.6 / (n**0.6).sum()
    np.testing.assert_allclose(task_probabilities(SIZES, "annealed", 2, 3), expected, rtol=1e-15)
    # first epoch = proportional, last close to uniform
    np.testing.assert_allclose(task_probabilities(SIZES, "annealed", 1, 4), n / n.sum(), rtol=1e-15)
    last = task_probabilities(SIZES, "annealed", 4, 4)
    np.testing.assert_allclose(last, n**0.2 / (n**0.2).sum(), rtol=1e-15)
    # hand-computed value for two tasks of 1 and 4 examples with alpha 0.5 (epoch 3 of 5: 1 - 0.8 * 2/4 = 0.6)
    p = task_probabilities([1, 4], "annealed", 3, 5)
    assert p[1] == pytest.approx(4**0.6 / (1 + 4**0.6), rel=1e-15)


def test_probability_errors():
    with pytest.raises(ValueError, match="sizes"):
        task_probabilities([10, 0], "uniform")
    with pytest.raises(ValueError, match="round_robin"):
        task_probabilities(SIZES, "round_robin")
    with pytest.raises(ValueError, match="sampling method"):
        TaskSampler("bogus", SIZES, [1, 1, 1], 1, 10)


@pytest.mark.parametrize("method", ["proportional", "uniform", "sqrt", "annealed"])
def test_empirical_frequencies(method):
    sampler = TaskSampler(method, SIZES, [1, 1, 1], num_epochs=3, updates_per_epoch=20000, seed=1)
    for epoch in (1, 3):
        counts = Counter(sampler.epoch_order(epoch))
        freq = np.array([counts[t] for t in range(3)]) / 20000
        p = task_probabilities(SIZES, method, epoch, 3)
        # 5 standard deviations of a binomial proportion
        assert np.all(np.abs(freq - p) < 5 * np.sqrt(p * (1 - p) / 20000)), (method, epoch, freq, p)


def test_round_robin_visits_every_task_and_exhausts_each():
    assert round_robin_order([2, 1, 3]) == [0, 1, 2, 0, 2, 2]
    batches = [5, 9, 2]
    sampler = TaskSampler("round_robin", [50, 90, 20], batches, num_epochs=2, updates_per_epoch=None)
    order = []
    while not sampler.epoch_done():
        order.extend(sampler.next_update())
    assert Counter(order) == {0: 5, 1: 9, 2: 2}
    assert order[:3] == [0, 1, 2]  # not task 0 only (the Bert-n-Pals pitfall)
    sampler.start_next_epoch()
    assert sampler.epoch == 2 and sampler.next_update() == [0]
    # with accumulation: updates group 2 micro-batches, the last one may be short
    acc = TaskSampler("round_robin", [50, 90, 20], batches, 1, None, micro_batches_per_update=3)
    assert acc.updates_per_epoch == math.ceil(16 / 3)
    groups = [acc.next_update() for _ in range(acc.updates_per_epoch)]
    assert [len(g) for g in groups] == [3, 3, 3, 3, 3, 1]
    # a cap on updates cuts the pass short
    capped = TaskSampler("round_robin", [50, 90, 20], batches, 1, 4)
    assert len(capped.epoch_order(1)) == 4 and set(capped.epoch_order(1)) == {0, 1, 2}


def test_grouped_methods():
    rrr = TaskSampler("random_round_robin", SIZES, [1, 1, 1], 2, updates_per_epoch=50, seed=3)
    assert rrr.group_size == 3
    for _ in range(50):
        assert sorted(rrr.next_update()) == [0, 1, 2]
    assert rrr.epoch_done()
    with pytest.raises(StopIteration):
        rrr.next_update()
    orders = {tuple(rrr.epoch_order(1)[i : i + 3]) for i in range(0, 150, 3)}
    assert len(orders) > 1  # the order within an update is random
    every = TaskSampler("every_task_plus_annealed", SIZES, [1, 1, 1], 2, 4000, extra=2, seed=0)
    assert every.group_size == 5
    extras = []
    for _ in range(4000):
        group = every.next_update()
        assert sorted(group[:3]) == [0, 1, 2]
        extras.extend(group[3:])
    freq = np.bincount(extras, minlength=3) / len(extras)
    p = task_probabilities(SIZES, "annealed", 1, 2)
    assert np.all(np.abs(freq - p) < 5 * np.sqrt(p * (1 - p) / len(extras)))


@pytest.mark.parametrize("method", SAMPLING_METHODS)
def test_resume_gives_the_same_stream(method):
    def make():
        return TaskSampler(method, SIZES, [7, 11, 5], 3, None if method == "round_robin" else 9, seed=5)

    reference = make()
    full = []
    for epoch in range(1, 4):
        while not reference.epoch_done():
            full.append(reference.next_update())
        if epoch < 3:
            reference.start_next_epoch()
    first = make()
    got = [first.next_update() for _ in range(4)]
    state = first.state_dict()
    second = make()
    second.load_state_dict(state)
    while True:
        while not second.epoch_done():
            got.append(second.next_update())
        if second.epoch == 3:
            break
        second.start_next_epoch()
    assert got == full
    assert make().epoch_order(2) == make().epoch_order(2)  # pure function of (seed, epoch)
    other = TaskSampler(method, SIZES, [7, 11, 5], 3, None if method == "round_robin" else 9, seed=6)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)


def test_state_dict_is_a_copy():
    sampler = TaskSampler("annealed", SIZES, [7, 11, 5], 3, 9, seed=5)
    before = copy.deepcopy(sampler.state_dict())
    for value in sampler.state_dict().values():
        if isinstance(value, list):
            value[0] = -1  # a caller editing the returned state must not change the sampler
    assert sampler.state_dict() == before
