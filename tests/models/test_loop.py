"""The shared training loop (``models.training.loop``) against a scripted strategy: evaluation cadence, best state,
patience, checkpoints and resume, without a model."""

from __future__ import annotations

import copy

import pytest

from models.training.loop import LoopConfig, LoopState, run_loop


class Crash(Exception):
    pass


class Scripted:
    """Epochs of ``steps_per_epoch`` steps; the n-th evaluation scores ``scores[n]`` (lower is better)."""

    is_main = True

    def __init__(self, scores, steps_per_epoch=3, crash_at=None):
        self.scores, self.steps_per_epoch, self.crash_at = scores, steps_per_epoch, crash_at
        self.stepped, self.kept, self.saved = [], [], []

    def epoch_steps(self, epoch):
        return [(epoch, i) for i in range(self.steps_per_epoch)]

    def train_step(self, batch, step, epoch):
        if step == self.crash_at:
            raise Crash
        assert batch == (epoch, step % self.steps_per_epoch)  # the step's own batch, also after a resume
        self.stepped.append(step)
        return 0.5

    def evaluate(self, state):
        return {"step": state.step, "valid_ne": self.scores[len(state.history)]}

    def agree(self, value):
        return value

    def keep_best(self, state):
        self.kept.append(state.step)

    def save_checkpoint(self, state):
        self.saved.append(copy.deepcopy(state))


def cfg(**kw) -> LoopConfig:
    return LoopConfig(**{"epochs": 6, "patience": 2, "select": "valid_ne", "higher_is_better": False, **kw})


def test_keeps_the_best_evaluation_and_stops_when_patience_runs_out():
    s = Scripted([1.0, 0.8, 0.7, 0.75, 0.72, 0.6, 0.5])  # best at epoch 2, then 2 evaluations without gain
    state = run_loop(s, cfg(), LoopState())
    assert [h["step"] for h in state.history] == [0, 3, 6, 9, 12]
    assert (state.best, state.best_step, state.best_epoch) == (0.7, 6, 2)
    assert s.kept == [0, 3, 6]  # the untrained model, then every improvement
    assert state.step == 12 and s.stepped == list(range(12))  # stopped after epoch 4 of 6
    assert [c.step for c in s.saved] == [3, 6, 9, 12]  # one checkpoint per evaluation
    s = Scripted(s.scores)
    run_loop(s, cfg(checkpoint_every=0), LoopState())
    assert [c.step for c in s.saved] == [12]  # only where the run ends (a rerun then finishes at once)


def test_every_rank_acts_on_rank_0s_evaluation():
    class OtherRank(Scripted):
        """Its own scores keep improving; rank 0's (the scripted ones) reach it through ``agree``."""

        def evaluate(self, state):
            self.rank0 = super().evaluate(state)
            return {"step": state.step, "valid_ne": -float(state.step)}

        def agree(self, value):
            return self.rank0

    s = OtherRank([1.0, 0.8, 0.7, 0.75, 0.72, 0.6, 0.5])
    state = run_loop(s, cfg(), LoopState())
    assert (state.best_step, state.step) == (6, 12) and s.kept == [0, 3, 6]  # as on rank 0


def test_higher_is_better_and_a_run_without_improvement_keeps_the_untrained_model():
    s = Scripted([0.1, 0.3, 0.2, 0.2])
    state = run_loop(s, cfg(higher_is_better=True, select="valid_ne"), LoopState())
    assert state.best_step == 3 and state.step == 9
    s = Scripted([0.5, 0.6, 0.7])
    state = run_loop(s, cfg(), LoopState())
    assert state.best_step == 0 and s.kept == [0] and state.step == 6


def test_step_cadence_budget_and_periodic_checkpoints():
    s = Scripted([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4], steps_per_epoch=5)
    state = run_loop(s, cfg(eval_every=4, max_steps=11, checkpoint_every=5), LoopState())
    assert [h["step"] for h in state.history] == [0, 4, 8, 11]  # and the end of the budget
    assert state.step == 11 and state.epoch == 3
    assert [c.step for c in s.saved] == [5, 10, 11]


def test_resume_from_a_mid_epoch_checkpoint_ends_like_an_unbroken_run():
    scores = [1.0, 0.9, 0.8, 0.85, 0.7, 0.75, 0.76]
    settings = cfg(eval_every=2, checkpoint_every=4)
    unbroken = run_loop(Scripted(scores), settings, LoopState())

    crashing = Scripted(scores, crash_at=9)
    with pytest.raises(Crash):
        run_loop(crashing, settings, LoopState())
    saved = crashing.saved[-1]
    assert saved.step == 8 and saved.step % 3  # in the middle of epoch 3
    resumed = Scripted(scores)
    state = run_loop(resumed, settings, copy.deepcopy(saved))
    assert resumed.stepped[0] == 8  # nothing replayed
    assert state == unbroken
    assert state.step < 18 and state.best_step == 8  # stopped early, in both


def test_non_finite_loss_stops_the_run():
    class Diverging(Scripted):
        def train_step(self, batch, step, epoch):
            return float("nan")

    with pytest.raises(FloatingPointError, match="at step 0"):
        run_loop(Diverging([1.0]), cfg(), LoopState())


def test_a_second_metric_keeps_its_own_best_state_and_never_stops_the_run():
    class TwoMetrics(Scripted):
        """``valid_other`` peaks early and only every other evaluation carries it; ``valid_ne`` improves on."""

        other = [0.9, 0.4, None, 0.3, 0.3, 0.6, 0.2]

        def evaluate(self, state):
            out = super().evaluate(state)
            value = self.other[len(state.history)]
            return out if value is None else {**out, "valid_other": value}

        def keep_also(self, state):
            self.also.append(state.step)

    s = TwoMetrics([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    s.also = []
    state = run_loop(s, cfg(also="valid_other"), LoopState())
    # lower is better here: 0.9, then 0.4 (step 3); 0.3 at step 9 (the missing value at step 6 does not count);
    # the equal 0.3 and the worse 0.6 keep it; 0.2 at the end
    assert s.also == [0, 3, 9, 18]
    assert state.step == 18 and state.best_step == 18  # patience reads valid_ne alone: no early stop
    assert s.kept == [0, 3, 6, 9, 12, 15, 18]
