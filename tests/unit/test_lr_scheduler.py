"""OptimizerParamScheduler against closed-form learning-rate and weight-decay curves."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

MAX_LR, MIN_LR, INIT_LR = 1e-3, 1e-4, 0.0
WARMUP, DECAY = 10, 110


def make(style="cosine", *, groups=None, warmup=WARMUP, decay=DECAY, **overrides):
    optimizer = SimpleNamespace(param_groups=groups if groups is not None else [{}])
    kwargs = dict(init_lr=INIT_LR, max_lr=MAX_LR, min_lr=MIN_LR, lr_warmup_steps=warmup,
                  lr_decay_steps=decay, lr_decay_style=style, start_wd=0.1, end_wd=0.1,
                  wd_incr_steps=DECAY, wd_incr_style="constant")
    kwargs.update(overrides)
    return OptimizerParamScheduler(optimizer, **kwargs)


def lrs(scheduler, steps):
    values = []
    for _ in range(steps):
        values.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.step(1)
    return values


def expected(style, step, warmup=WARMUP, decay=DECAY):
    if warmup > 0 and step <= warmup:
        return INIT_LR + (MAX_LR - INIT_LR) * step / warmup
    if style == "constant":
        return MAX_LR
    if step > decay:
        return MIN_LR
    if style == "inverse-square-root":
        return max(MIN_LR, MAX_LR * math.sqrt(max(warmup, 1)) / math.sqrt(step))
    progress = (step - warmup) / (decay - warmup)
    if style == "linear":
        return MIN_LR + (MAX_LR - MIN_LR) * (1 - progress)
    return MIN_LR + (MAX_LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root"])
def test_decay_styles_follow_closed_forms(style):
    got = lrs(make(style), DECAY + 20)
    assert got == pytest.approx([expected(style, s) for s in range(DECAY + 20)], rel=1e-12)


def test_cosine_reaches_min_lr_and_warmup_peaks_at_max_lr():
    got = lrs(make("cosine"), DECAY + 5)
    assert got[0] == INIT_LR and got[WARMUP] == pytest.approx(MAX_LR)
    assert got[DECAY] == pytest.approx(MIN_LR) and got[DECAY + 4] == MIN_LR


def test_warmup_given_as_fraction_is_converted_by_the_caller():
    fraction = 0.25
    warmup = int(fraction * DECAY)  # what the training arguments do with --lr-warmup-fraction
    got = lrs(make("linear", warmup=warmup), DECAY)
    assert got == pytest.approx([expected("linear", s, warmup=warmup) for s in range(DECAY)])


def test_no_warmup_starts_at_max_lr():
    assert lrs(make("cosine", warmup=0), 1) == [pytest.approx(MAX_LR)]


@pytest.mark.parametrize("wsd_style", ["linear", "cosine", "exponential"])
def test_wsd_holds_then_anneals_in_the_last_steps(wsd_style):
    scheduler = make("WSD", wsd_decay_steps=20, lr_wsd_decay_style=wsd_style)
    got = lrs(scheduler, DECAY + 2)
    assert got[WARMUP:DECAY - 20 + 1] == pytest.approx([MAX_LR] * (DECAY - 20 - WARMUP + 1))
    halfway = got[DECAY - 10]
    mid = {"linear": 0.5, "cosine": 0.5, "exponential": 2 * 0.5 ** 0.5 - 1}[wsd_style]
    assert halfway == pytest.approx(MIN_LR + (MAX_LR - MIN_LR) * mid)
    assert got[DECAY] == pytest.approx(MIN_LR) and got[DECAY + 1] == MIN_LR


def test_groups_use_their_own_bounds_and_multipliers():
    groups = [{"max_lr": 2e-3, "min_lr": 0.0, "lr_mult": 0.5, "wd_mult": 0.0}, {}]
    scheduler = make("linear", groups=groups, warmup=0, start_wd=0.0, end_wd=0.2,
                     wd_incr_steps=10, wd_incr_style="linear")
    scheduler.step(5)
    assert groups[0]["lr"] == pytest.approx(2e-3 * (1 - 5 / DECAY) * 0.5)
    assert groups[0]["weight_decay"] == 0.0
    assert groups[1]["lr"] == pytest.approx(expected("linear", 5, warmup=0))
    assert groups[1]["weight_decay"] == pytest.approx(0.1)
    scheduler.step(20)
    assert groups[1]["weight_decay"] == pytest.approx(0.2)


def test_cosine_weight_decay_increment():
    scheduler = make("constant", start_wd=0.0, end_wd=0.2, wd_incr_steps=8,
                     wd_incr_style="cosine")
    values = []
    for _ in range(10):
        values.append(scheduler.get_wd())
        scheduler.step(1)
    assert values == pytest.approx(
        [0.2 * 0.5 * (1 - math.cos(math.pi * s / 8)) if s <= 8 else 0.2 for s in range(10)])


def test_state_dict_round_trip_and_mismatch_policy():
    scheduler = make("cosine")
    scheduler.step(37)
    state = scheduler.state_dict()
    resumed = make("cosine")
    resumed.load_state_dict(state)
    assert resumed.num_steps == 37
    assert resumed.optimizer.param_groups[0]["lr"] == scheduler.optimizer.param_groups[0]["lr"]

    different = make("cosine", max_lr=2e-3, use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match="max_lr"):
        different.load_state_dict(state)
    taken = make("cosine", max_lr=2e-3)
    taken.load_state_dict(state)
    assert taken.max_lr == MAX_LR
    kept = make("cosine", max_lr=2e-3, use_checkpoint_opt_param_scheduler=False,
                override_opt_param_scheduler=True)
    kept.load_state_dict(state)
    assert kept.max_lr == 2e-3

    legacy = {"start_lr": MAX_LR, "min_lr": MIN_LR, "warmup_iter": WARMUP, "end_iter": DECAY,
              "decay_style": "cosine", "num_iters": 12}
    old = make("cosine")
    old.load_state_dict(legacy)
    assert old.num_steps == 12


@pytest.mark.parametrize("overrides,field", [
    ({"lr_decay_style": "step"}, "lr_decay_style"),
    ({"lr_warmup_steps": DECAY}, "lr_warmup_steps"),
    ({"min_lr": 2 * MAX_LR}, "min_lr"),
    ({"lr_decay_style": "WSD"}, "wsd_decay_steps"),
    ({"wd_incr_style": "constant", "end_wd": 0.3}, "start_wd == end_wd"),
])
def test_bad_settings_are_rejected_by_name(overrides, field):
    with pytest.raises(ValueError, match=field):
        make(**{"style": overrides.pop("lr_decay_style", "cosine"), **overrides})
