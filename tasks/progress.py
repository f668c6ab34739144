"""What a person watching a run sees, besides each stage's result: the training task's step and
checkpoint lines at a rate one reads in Prefect's UI (about LINES_PER_RUN a run, the first steps
and the last always), the expected end of the epoch and of the run once the first steps are
timed, a line now and then while a long evaluation runs, and, where `grpo run` and `grpo eval`
turn them on (a terminal), progress bars.

The bars are rich's, fed the workers' events (tasks.process.add_listener) and drawn on the console
Prefect's own log handler writes to, so that the log's lines scroll above them; without
terminal_bars (a pipe, CI, a served flow run) nothing is drawn.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import time
from typing import Callable, Iterator

from rich.console import Console
from rich.default_styles import DEFAULT_STYLES
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.text import Text
from rich.theme import Theme

from tasks.process import add_listener

LINES_PER_RUN = 50  # step lines of a whole run, when train.log_every is not set
FIRST_LINES = 3  # a worker's first steps are always logged: a user wants to see it start
# A worker states when its epoch and the run should end after its first ETA_AFTER steps (the first
# one compiles, so it is not timed), or ETA_AFTER_S after its first step when steps are slow.
ETA_AFTER, ETA_AFTER_S = 10, 60.0
EVAL_LINE_S = 10.0  # an evaluation says how far it is this often (piped output is otherwise silent)


def step_every(num_steps: int, log_every: int | None = None) -> int:
    """Steps between the training task's step lines: train.log_every, else about LINES_PER_RUN a run."""
    return log_every or max(1, math.ceil(num_steps / LINES_PER_RUN))


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{minutes} min" if minutes < 90 else f"{minutes // 60} h {minutes % 60:02d} min"


def _clock_time(seconds_from_now: float) -> str:
    """The local time `seconds_from_now` from now: 14:05, or with its date when not today."""
    now = datetime.datetime.now().astimezone()
    at = now + datetime.timedelta(seconds=seconds_from_now)
    return at.strftime("%H:%M" if at.date() == now.date() else "%Y-%m-%d %H:%M")


class TrainLog:
    """Which of one training worker's step and checkpoint events become lines of the task's log,
    and the expected ends it states. Steps count from 1 (the step just done)."""

    def __init__(self, epoch: int, num_steps: int, until: int, every: int, clock: Callable[[], float] = time.monotonic):
        self.epoch, self.num_steps, self.until, self.every, self.clock = epoch, num_steps, until, every, clock
        self.steps = 0  # step events of this worker
        self.first: tuple[int, float] | None = None  # (step, time) of its first step
        self.rate: float | None = None  # steps a second since then
        self.checkpoints_said = 0  # checkpoint lines of this worker
        self.said_since_line = False  # a checkpoint line since the last step line
        self.unsaid: list[int] = []  # checkpoints saved since the last checkpoint line
        self.eta_said = False

    def step(self, s: int) -> bool:
        """Step `s` is done: whether it gets a line."""
        now = self.clock()
        self.steps += 1
        if self.first is None:
            self.first = (s, now)
        elif now > self.first[1]:
            self.rate = (s - self.first[0]) / (now - self.first[1])
        line = self.steps <= FIRST_LINES or s % self.every == 0 or s == self.until
        if line:
            self.said_since_line = False
        return line

    def checkpoint(self, step: int) -> list[int] | None:
        """Checkpoint `step` is saved: None when it gets no line of its own, else the steps of the
        checkpoints saved since the last line about one, which this line mentions. A line: the
        worker's first, its last (the epoch's end), and the first after each step line."""
        if self.checkpoints_said and self.said_since_line and step != self.until:
            self.unsaid.append(step)
            return None
        unsaid, self.unsaid = self.unsaid, []
        self.checkpoints_said += 1
        self.said_since_line = True
        return unsaid

    def remaining_s(self, s: int, to: int) -> float | None:
        return None if not self.rate else max(0, to - s) / self.rate

    def eta(self, s: int) -> str | None:
        """Once, after the first timed steps: when the epoch and the run's training should end."""
        if self.eta_said or self.rate is None or s >= self.until or self.first is None:
            return None
        if self.steps <= ETA_AFTER and (self.steps < 3 or self.clock() - self.first[1] < ETA_AFTER_S):
            return None
        self.eta_said = True
        epoch_s, run_s = self.remaining_s(s, self.until), self.remaining_s(s, self.num_steps)
        said = (
            f"epoch {self.epoch}: {self.rate:.3g} steps/s; it should end (step {self.until}) at about "
            f"{_clock_time(epoch_s)} (in {_duration(epoch_s)})"
        )
        if self.num_steps > self.until:
            said += (
                f", the run's training (step {self.num_steps}) at about {_clock_time(run_s)} (in {_duration(run_s)})"
            )
        return said + "; evaluations and exports come after"

    def step_suffix(self, s: int) -> str:
        """The run's expected end, for a step line (once the steps are timed)."""
        left = self.remaining_s(s, self.num_steps) if self.steps > 1 else None
        if left is None or s >= self.num_steps:
            return ""
        # within two minutes a clock time reads as now ("run ETA 03:25" printed at 03:25): say the seconds
        return f"  run ETA in {left:.0f} s" if left < 120 else f"  run ETA {_clock_time(left)}"


class RolloutLog:
    """The rollout side of an asynchronous run (train.max_staleness, train.rollout.layout), from a
    training worker's events: where it runs, the version each step's batch came from, and the
    seconds each side waited, summed over the worker's steps for the epoch's artifact."""

    def __init__(self):
        self.side: dict | None = None  # the rollout_side event: layout, max_staleness, pid and cores (split)
        self.steps = 0
        self.staleness_sum = self.staleness_max = 0.0
        self.waits = {"learner_wait_s": 0.0, "rollout_wait_s": 0.0, "rollout_busy_s": 0.0}
        self.version: int | None = None

    def started(self, e: dict) -> str:
        self.side = e
        where = (
            f"in a process of its own (pid {e['pid']}, cores {e['rollout_cores']}; the learner's "
            f"{e['learner_cores']}; its log {e['log']})"
            if e["layout"] == "split"
            else "in a thread of the learner's process"
        )
        return f"the rollout runs {where}, at most {e['max_staleness']} policy version(s) behind the learner"

    def step(self, e: dict) -> str:
        """A step event's rollout part: its batch's version and staleness, and the waits (empty when synchronous)."""
        if "async/version" not in e:
            return ""
        self.steps += 1
        self.version = int(e["async/version"])
        self.staleness_sum += e["async/staleness"]
        self.staleness_max = max(self.staleness_max, e["async/staleness"])
        for k in self.waits:
            self.waits[k] += e[f"async/{k}"]
        return (
            f"  rollout v{self.version} (staleness {e['async/staleness']:.0f}), waited: learner "
            f"{1000 * e['async/learner_wait_s']:.0f} ms, rollout {1000 * e['async/rollout_wait_s']:.0f} ms"
        )

    def row(self, epoch: int) -> dict | None:
        """The epoch's row of the rollout artifact; None when no step was asynchronous."""
        if not self.steps or self.side is None:
            return None
        return {
            "epoch": epoch,
            "layout": self.side["layout"],
            "max_staleness": self.side["max_staleness"],
            "steps": self.steps,
            "last_version": self.version,
            "staleness_mean": round(self.staleness_sum / self.steps, 3),
            "staleness_max": self.staleness_max,
            **{k: round(v, 3) for k, v in self.waits.items()},
            "pid": self.side.get("pid"),
        }


def checkpoint_line(uri: str, unsaid: list[int]) -> str:
    if not unsaid:
        return f"checkpoint {uri}"
    which = f"step {unsaid[0]}" if len(unsaid) == 1 else f"steps {unsaid[0]}..{unsaid[-1]}"
    return f"checkpoint {uri} (and {len(unsaid)} saved since the last checkpoint line: {which})"


class EvalLog:
    """When an evaluation says how far it is: at its start (it can take a while before a first
    batch is done: its programs compile), then every EVAL_LINE_S, not at its end (its result says it)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock, self.last = clock, {}

    def due(self, step: int, done: int, total: int) -> bool:
        now = self.clock()
        if step not in self.last:
            self.last[step] = now
            return done < total
        if done >= total or now - self.last[step] < EVAL_LINE_S:
            return False
        self.last[step] = now
        return True


# -- the terminal's bars ----------------------------------------------------------------------------


class _Rate(ProgressColumn):
    """steps/s (or prompts/s) of a bar, once rich has measured it."""

    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        unit = task.fields.get("unit", "it")
        shown = "" if speed is None else f"{speed:.0f} {unit}/s" if speed >= 100 else f"{speed:.3g} {unit}/s"
        return Text(shown, style="progress.data.speed")


class _Bars:
    """A bar of the run's training steps (steps/s, the time left to the run's last step) and one
    for each evaluation while it runs (prompts done of its passes), fed the workers' events."""

    def __init__(self, console: Console, redirect_stdout: bool, num_steps: int | None):
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[unit]}"),
            _Rate(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            redirect_stdout=redirect_stdout,
            refresh_per_second=4,
        )
        self.num_steps, self.train, self.evals = num_steps, None, {}

    def on_event(self, e: dict) -> None:
        kind, p = e.get("event"), self.progress
        if kind in ("start", "resumed", "step") and self.num_steps:
            done = int(e["step"]) + (kind == "step")  # a step event's "step" is the one just run, from 0
            if self.train is None:
                self.train = p.add_task("training", total=self.num_steps, completed=done, unit="steps")
            else:
                p.update(self.train, completed=done)
        elif kind == "eval_progress":
            if e["step"] not in self.evals:  # its passes said: 20 rows greedy then sampled read 20/40, not 20/20
                what = f"eval step {e['step']}"
                if e.get("passes", 1) > 1:
                    what += f" ({e['passes']} passes × {e['rows']} prompts: greedy, then sampled)"
                self.evals[e["step"]] = p.add_task(what, total=e["total"], unit="prompts")
            p.update(self.evals[e["step"]], completed=e["done"], total=e["total"])
        elif kind == "eval" and e["step"] in self.evals:  # done: its log line gives the result
            p.remove_task(self.evals.pop(e["step"]))


def _console() -> Console:
    """The console Prefect's log handler (PrefectConsoleHandler, on the root logger) prints to, so that
    its lines scroll above the bars; else stderr's (`grpo eval`, which loads no Prefect)."""
    for handler in logging.getLogger().handlers:
        if isinstance(getattr(handler, "console", None), Console):
            return handler.console
    return Console(stderr=True)


@contextlib.contextmanager
def terminal_bars(enabled: bool, num_steps: int | None = None, redirect_stdout: bool = False) -> Iterator[None]:
    """Progress bars of the workers' events while the block runs, when `enabled` (flows.cli: where
    stderr is a terminal); `num_steps`: the run's train.num_steps (None: no training bar)."""
    if not enabled:
        yield
        return
    console = _console()
    # Prefect's console has a theme of its own (inherit=False): the bars' styles are added to it
    console.push_theme(Theme({k: v for k, v in DEFAULT_STYLES.items() if k.startswith(("bar.", "progress."))}))
    bars = _Bars(console, redirect_stdout, num_steps)
    failed: list[Exception] = []

    def on_event(e: dict) -> None:  # a display error never stops a stage: said once, then no bars
        if failed:
            return
        try:
            bars.on_event(e)
        except Exception as exc:  # noqa: BLE001 - anything drawing on the terminal raises
            failed.append(exc)
            logging.getLogger(__name__).warning("progress bars turned off: %s: %s", type(exc).__name__, exc)

    try:
        with bars.progress:
            stop = add_listener(on_event)
            try:
                yield
            finally:
                stop()
    finally:
        console.pop_theme()
