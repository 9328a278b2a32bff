"""The go-live checks of a job (sidecar/ranks/golive.py), judged from real Rank records."""

from __future__ import annotations

import argparse
import math

import pytest

from sidecar.config import ConfigError, settings_from_args
from sidecar.ranks.golive import GIB, GoLive
from sidecar.ranks.model import Rank

SHARE = 0.2


def rank(n: int, step: int | None = 10, local_world_size: int = 4, world_size: int = 8, **metrics: float) -> Rank:
    r = Rank("job", n, n, world_size, local_world_size, pid=1000 + n, pid_start_time=1.0)
    r.step = step
    r.metrics.update(metrics)
    if step is not None:
        r.step_times.extend([0.30, 0.31, 0.30])
    return r


def judged(ranks, memory=None, golive=None, window=50) -> dict:
    golive = golive or GoLive()
    mem = {("job", k): v for k, v in (memory or {}).items()}
    return golive.evaluate(ranks, mem, window, SHARE)["job"]


def check(job: dict, name: str) -> tuple[str, str]:
    c = job["checks"][name]
    return c["state"], c["text"]


def feed(golive: GoLive, losses: list[float], first: int = 1, window: int = 50) -> None:
    golive.observe("job", [(first + i, loss) for i, loss in enumerate(losses)], window)


def test_balanced_memory_is_ok():
    job = judged([rank(i) for i in range(4)], {0: 22.0 * GIB, 1: 22.2 * GIB, 2: 22.4 * GIB, 3: 22.1 * GIB})
    state, text = check(job, "gpu_memory")
    assert state == "ok", text
    assert "22.0-22.4 GiB" in text


def test_a_rank_using_much_more_memory_is_a_warning_naming_it_and_the_share():
    job = judged([rank(i) for i in range(4)], {0: 22.0 * GIB, 1: 22.2 * GIB, 2: 22.4 * GIB, 3: 31.2 * GIB})
    state, text = check(job, "gpu_memory")
    assert state == "warning"
    assert text == "rank 3 uses 31.2 GiB, the others 22.0-22.4 GiB (+41%)"
    assert job["state"] == "warning"


def test_memory_is_pending_until_every_rank_stepped_and_unavailable_without_nvml():
    waiting = judged([rank(0), rank(1, step=None)], {0: GIB, 1: GIB})
    assert check(waiting, "gpu_memory")[0] == "pending"
    missing = judged([rank(0), rank(1)], {0: GIB})
    assert check(missing, "gpu_memory") == ("pending", "GPU memory of rank 1 not seen yet")
    assert check(judged([rank(0), rank(1)]), "gpu_memory")[0] == "unavailable"


def test_unbalanced_throughput_is_a_warning():
    ranks = [rank(i, tokens_per_second=1500.0 + i) for i in range(3)] + [rank(3, tokens_per_second=1000.0)]
    state, text = check(judged(ranks), "throughput")
    assert state == "warning"
    assert text.startswith("rank 3 at 1000 tokens/s, the others 1500-1502 tokens/s (-33%)"), text


def test_balanced_step_times_are_ok():
    state, text = check(judged([rank(i) for i in range(2)]), "throughput")
    assert state == "ok", text


def test_a_falling_loss_is_ok():
    golive = GoLive()
    feed(golive, [2.31 - 0.01 * i for i in range(50)])
    state, text = check(judged([rank(0, local_world_size=1)], golive=golive), "loss")
    assert state == "ok", text
    assert text.startswith("loss fell over steps 1-50")


def test_a_loss_that_does_not_fall_is_a_warning_with_both_values():
    golive = GoLive()
    feed(golive, [2.31] * 10 + [2.32] * 30 + [2.33] * 10)
    state, text = check(judged([rank(0, local_world_size=1)], golive=golive), "loss")
    assert (state, text) == ("warning", "loss did not fall over steps 1-50: 2.31 -> 2.33")


def test_the_loss_is_pending_before_n_steps_and_ignores_later_steps():
    golive = GoLive()
    feed(golive, [3.0 - 0.1 * i for i in range(20)])
    assert check(judged([rank(0, local_world_size=1)], golive=golive), "loss") == ("pending", "at step 20 of 1-50")
    feed(golive, [5.0] * 40, first=21)  # steps 51-60 lie outside the window
    state, text = check(judged([rank(0, local_world_size=1)], golive=golive), "loss")
    assert state == "warning" and "steps 1-50" in text


def test_a_nonfinite_loss_is_a_warning():
    golive = GoLive()
    feed(golive, [2.0, math.nan] + [1.0] * 48)
    assert check(judged([rank(0, local_world_size=1)], golive=golive), "loss")[0] == "warning"


def test_missing_ranks_keep_the_job_pending():
    job = judged([rank(0), rank(1)])
    assert check(job, "ranks_joined") == ("pending", "2 of 4 local ranks registered (world size 8)")
    assert job["state"] == "pending"
    full = judged([rank(i) for i in range(4)])
    assert check(full, "ranks_joined")[0] == "ok"


def test_a_rank_before_its_first_step_keeps_first_batch_pending():
    state, text = check(judged([rank(0), rank(1, step=None)]), "first_batch")
    assert (state, text) == ("pending", "rank 1 not past its first batch yet")


def test_the_metric_says_1_ok_0_warning_minus_1_pending_and_nothing_unavailable():
    golive = GoLive()
    ranks = [rank(i, local_world_size=2) for i in range(2)]
    memory = {("job", 0): 10 * GIB, ("job", 1): 20 * GIB}
    (family,) = golive.families(golive.evaluate(ranks, memory, 50, SHARE))
    values = {s.labels["check"]: s.value for s in family.samples}
    assert values == {"ranks_joined": 1.0, "first_batch": 1.0, "gpu_memory": 0.0, "throughput": 1.0, "loss": -1.0}
    (family,) = golive.families(golive.evaluate(ranks, {}, 50, SHARE))
    assert "gpu_memory" not in {s.labels["check"] for s in family.samples}


def test_jobs_no_longer_registered_are_forgotten():
    golive = GoLive()
    feed(golive, [1.0, 0.9])
    golive.forget([])
    assert check(judged([rank(0, local_world_size=1)], golive=golive), "loss")[0] == "pending"


@pytest.mark.parametrize(
    "setting, fragment",
    [
        ("watchdog.golive_steps=1", "setting watchdog.golive_steps: must be in [2, 100000]"),
        ("watchdog.golive_steps=abc", "setting watchdog.golive_steps"),
        ("watchdog.golive_imbalance_ratio=0", "setting watchdog.golive_imbalance_ratio: must be in (0, 10]"),
        ("watchdog.golive_imbalance_ratio=nan", "setting watchdog.golive_imbalance_ratio"),
    ],
)
def test_bad_golive_settings_raise_one_line_naming_the_setting(setting, fragment):
    with pytest.raises(ConfigError) as err:
        settings_from_args(argparse.Namespace(set=[setting], config=None, listen=None, socket=None))
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_golive_settings_default_to_50_steps_and_20_percent():
    w = settings_from_args(argparse.Namespace(set=[], config=None, listen=None, socket=None)).watchdog
    assert (w.golive_steps, w.golive_imbalance_ratio) == (50, 0.2)


# ---------------------------------------------------------------- the figures a node sends its coordinator


def test_a_nodes_figures_carry_each_live_rank_rounded_and_the_loss_only_with_rank_0():
    from sidecar.ranks.golive import MIB

    golive = GoLive()
    feed(golive, [2.31 - 0.01 * i for i in range(50)])
    ranks = [rank(0, tokens_per_second=51234.5678), rank(1, step=None), rank(2)]
    ranks[2].gone = True
    got = golive.figures("job", ranks, {("job", 0): 22 * GIB + 1234}, 50, SHARE)
    assert got is not None and (got.expected, got.steps, got.share) == (4, 50, SHARE)
    assert [r.rank for r in got.ranks] == [0, 1], "a rank gone is not sent"
    zero, one = got.ranks
    assert zero.stepped and zero.memory == 22 * GIB and zero.memory % MIB == 0
    assert zero.tokens_per_second == 51230.0 and zero.step_seconds == 0.3
    assert not one.stepped and one.memory is None and one.step_seconds is None
    assert got.loss is not None and got.loss.head is not None and got.loss.tail < got.loss.head  # type: ignore[operator]
    elsewhere = golive.figures("job", [rank(4)], {}, 50, SHARE)
    assert elsewhere is not None and elsewhere.loss is None, "only rank 0's node sends the loss"
    assert golive.figures("other", ranks, {}, 50, SHARE) is None


def test_the_outlier_is_the_one_a_plain_median_of_the_others_names():
    import random
    import statistics

    from sidecar.ranks.golive import outlier

    def plain(values):
        best = None
        for r, v in values.items():
            med = statistics.median([w for q, w in values.items() if q != r])
            dev = abs(v - med) / med if med > 0 else (0.0 if v == med else math.inf)
            if best is None or (dev, v, -r) > best:
                best = (dev, v, -r)
        assert best is not None
        return -best[2]

    rng = random.Random(7)
    for n in (2, 3, 4, 5, 8, 17):
        for _ in range(50):
            values = {r: float(rng.choice([1, 2, 3, 5, 8, 0]) + rng.random() * rng.choice([0, 1])) for r in range(n)}
            assert outlier(values)[0] == plain(values), values  # type: ignore[index]
