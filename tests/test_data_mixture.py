"""MixtureSampler: weighted sources as a pure function of (seed, position); the prefetch thread."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from parallel3d.data import BatchSpec, MixtureSampler, Prefetcher, SourceTokens, StepSampler

SEQ = 8


def _sources() -> list[SourceTokens]:
    """Three sources; each token says its source (hundreds) so a window shows where it came from."""
    rng = np.random.default_rng(0)
    def source(name, base, sizes):
        return SourceTokens(name, [(base + rng.integers(0, 100, n)).astype(np.uint16) for n in sizes])
    return [source("a", 100, [81, 50]), source("b", 200, [400]), source("c", 300, [17, 17, 40])]


def _sampler(global_batch=8, micro=2, dp_rank=0, dp_size=1, seed=0, offset=0, weights=None) -> MixtureSampler:
    return MixtureSampler(_sources(), BatchSpec(global_batch, micro, SEQ, dp_rank, dp_size), seed, offset, weights)


def test_windows_come_from_their_source_and_never_straddle_token_files():
    sampler = _sampler(weights=[1, 1, 1])
    assert sampler.num_windows == [10 + 6, 49, 2 + 2 + 4]
    for step in range(1, 30):
        for (source, window), (inputs, targets) in zip(sampler.window_ids(step),
                                                       [(x, y) for mb in sampler.micro_batches(step) for x, y in zip(*mb)]):
            row = torch.cat([inputs, targets[-1:]])
            assert ((row // 100) == source + 1).all()  # all tokens from one source's file
            assert torch.equal(inputs[1:], targets[:-1])


@pytest.mark.parametrize("dp_size", [2, 4])
def test_dp_slices_concatenate_to_the_single_process_batch(dp_size):
    single = _sampler(global_batch=8)
    ranks = [_sampler(global_batch=8, micro=1, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    for step in range(1, 40):
        assert [w for s in ranks for w in s.window_ids(step)] == single.window_ids(step)


@pytest.mark.fast
def test_order_is_a_pure_function_of_seed_and_step():
    a, b = _sampler(seed=3), _sampler(seed=3)
    forward = [a.window_ids(s) for s in range(1, 600)]  # > one BLOCK of positions
    backward = [b.window_ids(s) for s in range(599, 0, -1)][::-1]
    assert forward == backward
    assert [_sampler(seed=4).window_ids(s) for s in range(1, 5)] != forward[:4]


def test_each_source_visits_every_window_once_per_epoch():
    sampler = _sampler(weights=[1, 1, 1])
    seen = [[], [], []]
    for step in range(1, 40):
        for source, window in sampler.window_ids(step):
            seen[source].append(window)
    for windows, n in zip(seen, sampler.num_windows):
        full = len(windows) // n
        for e in range(full):
            assert sorted(windows[e * n : (e + 1) * n]) == list(range(n))
        assert full >= 2 and windows[:n] != windows[n : 2 * n]


def test_weights_set_the_mixture_and_default_to_token_counts():
    steps = 1000  # 8000 samples
    weighted = _sampler(weights=[0.5, 0.3, 0.2])
    counts = np.bincount([s for step in range(1, steps + 1) for s, _ in weighted.window_ids(step)], minlength=3)
    np.testing.assert_allclose(counts / counts.sum(), [0.5, 0.3, 0.2], atol=0.02)
    consumed = weighted.tokens_consumed(steps)
    assert consumed == {f"tokens/{n}": int(c) * SEQ for n, c in zip("abc", counts)}
    assert sum(consumed.values()) == weighted.samples_seen(steps) * SEQ
    default = _sampler()
    tokens = np.array([s.num_tokens for s in _sources()], dtype=float)
    torch.testing.assert_close(default.weights, torch.tensor(tokens / tokens.sum(), dtype=torch.float64))
    assert _sampler(weights=[0, 1, 0]).tokens_consumed(7) == {"tokens/a": 0, "tokens/b": 56 * SEQ, "tokens/c": 0}


def test_resume_at_another_batch_size_and_dp_degree_continues_the_same_samples():
    before = _sampler(global_batch=8)
    stream = [w for step in range(1, 1201) for w in before.window_ids(step)]  # crosses blocks and epochs
    seen = before.samples_seen(700)
    offset = seen - 700 * 12  # train.py's restore(): samples_seen - step * new global batch
    ranks = [_sampler(global_batch=12, micro=3, dp_rank=r, dp_size=2, offset=offset) for r in range(2)]
    for step in (701, 702, 750):
        first = seen + (step - 701) * 12
        assert [w for s in ranks for w in s.window_ids(step)] == stream[first : first + 12]
    assert ranks[0].tokens_consumed(750) == before.tokens_consumed(700 + 50 * 12 // 8)


def test_too_little_data_raises():
    tiny = [SourceTokens("t", [np.zeros(SEQ * 3 + 1, np.uint16)]), SourceTokens("u", [np.zeros(SEQ, np.uint16)])]
    with pytest.raises(ValueError, match="source u holds no sequence"):
        MixtureSampler(tiny, BatchSpec(2, 1, SEQ), 0)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        MixtureSampler(tiny[:1], BatchSpec(4, 1, SEQ), 0)


def test_prefetcher_yields_the_samplers_batches_and_the_wait():
    tokens = np.arange(8 * 200 + 1, dtype=np.uint16) % 257
    sampler = StepSampler(tokens, BatchSpec(8, 2, SEQ), seed=0, name="n")

    class Slow:
        def micro_batches(self, step):
            time.sleep(0.2)
            return sampler.micro_batches(step)

    loader = Prefetcher(Slow(), 3, 6)
    waits = []
    for step in range(3, 7):
        batches, waited = loader.get(step)
        waits.append(waited)
        assert all(torch.equal(x, y) for a, b in zip(batches, sampler.micro_batches(step)) for x, y in zip(a, b))
        time.sleep(0.3)  # a step longer than preparing the next batch: no wait after the first
    loader.close()
    assert waits[0] > 0.1 and max(waits[1:]) < 0.1, waits
    assert sampler.tokens_consumed(4) == {"tokens/n": 4 * 8 * SEQ}
    with pytest.raises(ValueError, match="in order"):
        Prefetcher(sampler, 1, 2).get(2)


def test_prefetcher_raises_the_samplers_error_in_the_loop():
    class Broken:
        def micro_batches(self, step):
            raise OSError(f"disk gone at step {step}")

    with pytest.raises(OSError, match="step 1"):
        Prefetcher(Broken(), 1, 3).get(1)
