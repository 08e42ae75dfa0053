"""When the training loop's periodic work is due, and in which order it runs after a step.

After each training step `Trainer._run_steps` does what is due, always in this order:

1. **log** (every `train.log_every` steps, and the last): a train row (loss, rates, phases).
   With `checkpoint.dir` set the ranks then also agree whether any of them received a stop
   signal (hybridrec.train.preemption): a collective, so only at steps where every rank logs.
2. **save** (every `checkpoint.every` steps, the last, or on a stop signal): before evaluating,
   so that an error there cannot cost the training. Without `checkpoint.dir` saving does
   nothing.
3. **evaluate** (every `eval.every` steps, and the last; never after a stop signal). Reaching
   `eval.target_auc` / `eval.target_rmse` stops the run, saving first unless step 2 saved.
4. **stop** after a stop signal or a reached target.

A train row's rates cover the steps since the previous row (`Window`); an evaluation or a stop
restarts the window too, since their time is not training's. Each rule is a value (`Every`)
read from its component's key when the loop starts (`Cadence.of`), so a test that changes a
key after building the trainer is obeyed. A period of 0 (or None) means "only at the last
step".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from hybridrec.config import Config


@dataclass(frozen=True)
class Every:
    """Due at every `period`-th step (counted from 1; 0 or None: at none of them) and at the
    run's last step."""

    period: int | None

    def due(self, step: int, last_step: int) -> bool:
        return step == last_step or (bool(self.period) and step % self.period == 0)


@dataclass(frozen=True)
class Due:
    """What the loop does after one step, in the order of the fields (module docstring)."""

    log: bool
    save: bool
    evaluate: bool
    stop: bool = False

    def on_stop_signal(self) -> Due:
        """A stop signal the ranks agreed on at this (log) step: save, do not evaluate, stop."""
        return replace(self, save=True, evaluate=False, stop=True)

    def on_target(self) -> Due:
        """This step's evaluation reached its target: stop (the loop saves unless `save`)."""
        return replace(self, stop=True)

    @property
    def restarts_window(self) -> bool:
        """Whether the throughput window restarts after this step (evaluation or stop time
        is not throughput)."""
        return self.evaluate or self.stop


@dataclass(frozen=True)
class Cadence:
    """The due rules of logging, checkpoints and evaluation."""

    log: Every
    save: Every
    evaluate: Every

    @classmethod
    def of(cls, cfg: Config) -> Cadence:
        """Each rule from its key: train.log_every, checkpoint.every, eval.every."""
        return cls(Every(cfg.train.log_every), Every(cfg.checkpoint.every), Every(cfg.eval.every))

    def after(self, step: int, last_step: int) -> Due:
        """What is due after training step `step` of a run ending at `last_step`."""
        return Due(
            log=self.log.due(step, last_step),
            save=self.save.due(step, last_step),
            evaluate=self.evaluate.due(step, last_step),
        )


class Window:
    """The steps and seconds a train row's rates cover: since `restart(step)`."""

    def __init__(self, step: int) -> None:
        self.restart(step)

    def restart(self, step: int) -> None:
        self.step, self.start = step, time.perf_counter()

    def span(self, step: int) -> tuple[int, float]:
        """(steps, seconds) from the restart to now, at step `step`."""
        return step - self.step, time.perf_counter() - self.start
