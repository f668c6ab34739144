"""What a person watching a run sees (tasks/progress.py): step and checkpoint lines at a rate one
reads in Prefect's UI, the expected end of the epoch and of the run within the first steps, the
evaluation's progress as worker events, and in a terminal (only there) rich's progress bars."""

import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

from tasks.progress import LINES_PER_RUN, TrainLog, checkpoint_line, step_every

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Clock:
    """Seconds that pass as the test says: one step a second here."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _lines_of_a_run(num_steps: int, epochs: int, checkpoint_every: int) -> tuple[list[int], list[int]]:
    """The steps whose step line, and those whose checkpoint line, a run's training tasks log,
    fed the events its workers emit (one worker an epoch: a step, then its checkpoint)."""
    every, clock = step_every(num_steps), Clock()
    steps, checkpoints = [], []
    for epoch in range(epochs):
        start, until = epoch * num_steps // epochs, (epoch + 1) * num_steps // epochs
        log = TrainLog(epoch, num_steps, until, every, clock)
        for s in range(start + 1, until + 1):
            clock.t += 1.0
            if log.step(s):
                steps.append(s)
            if (s % checkpoint_every == 0 or s == until) and log.checkpoint(s) is not None:
                checkpoints.append(s)
    return steps, checkpoints


@pytest.mark.parametrize("checkpoint_every", [50, 10, 500])
def test_a_3000_step_run_logs_about_50_step_lines_and_checkpoints_with_them(checkpoint_every):
    steps, checkpoints = _lines_of_a_run(3000, epochs=4, checkpoint_every=checkpoint_every)
    assert step_every(3000) == 60 and step_every(3000, log_every=7) == 7 and step_every(20) == 1
    # every 60th step, the first three of each epoch's worker and each epoch's last (the run's last too)
    assert steps[:4] == [1, 2, 3, 60] and steps[-1] == 3000
    assert {750, 1500, 2250} <= set(steps) and LINES_PER_RUN <= len(steps) <= LINES_PER_RUN + 4 * 4
    assert max(b - a for a, b in zip(steps, steps[1:])) <= 60
    # a checkpoint line: a worker's first, each epoch's last, else only the first after a step line
    assert checkpoints[0] == min(checkpoint_every, 750) and {750, 1500, 2250, 3000} <= set(checkpoints)
    assert len(checkpoints) <= len(steps)
    if checkpoint_every == 10:
        assert checkpoints[:3] == [10, 60, 120]  # 20..50: saved between step lines 3 and 60, mentioned in 60's


def test_a_checkpoint_line_mentions_the_ones_saved_since_the_last():
    log = TrainLog(0, 3000, 3000, 60, Clock())
    said = {}
    for s in range(1, 71):
        log.step(s)
        if s % 10 == 0:
            said[s] = log.checkpoint(s)
    assert said == {10: [], 20: None, 30: None, 40: None, 50: None, 60: [20, 30, 40, 50], 70: None}
    assert checkpoint_line("gs://b/run/checkpoints/60", said[60]) == (
        "checkpoint gs://b/run/checkpoints/60 (and 4 saved since the last checkpoint line: steps 20..50)"
    )
    assert checkpoint_line("/r/checkpoints/70", [60]) == (
        "checkpoint /r/checkpoints/70 (and 1 saved since the last checkpoint line: step 60)"
    )
    assert checkpoint_line("/r/checkpoints/10", []) == "checkpoint /r/checkpoints/10"


def test_a_2800_step_run_states_its_end_within_its_first_20_steps():
    clock = Clock()
    log, said = TrainLog(0, 2800, 700, 56, clock), []
    clock.t = 100.0
    log.step(1)  # the first step compiles: its time is not counted
    for s in range(2, 21):
        clock.t += 2.0  # 0.5 steps/s
        log.step(s)
        if (eta := log.eta(s)) is not None:
            said.append((s, eta))
    ((at, eta),) = said  # once
    assert at <= 20, said
    assert re.fullmatch(
        r"epoch 0: 0.5 steps/s; it should end \(step 700\) at about (\d{4}-\d\d-\d\d )?\d\d:\d\d \(in 23 min\), "
        r"the run's training \(step 2800\) at about (\d{4}-\d\d-\d\d )?\d\d:\d\d \(in 1 h 33 min\); "
        r"evaluations and exports come after",
        eta,
    ), eta
    assert re.fullmatch(r"  run ETA (\d{4}-\d\d-\d\d )?\d\d:\d\d", log.step_suffix(20))
    assert log.step_suffix(2760) == "  run ETA in 80 s"  # near the end a clock time reads as now (issue 65)


def test_an_evaluation_says_it_started_then_how_far_it_is_every_few_seconds():
    """Piped output was silent up to 39 s in an evaluation (issue 65): a line at its start, then
    one every EVAL_LINE_S, none at its end (the result's line says it)."""
    from tasks.progress import EVAL_LINE_S, EvalLog

    clock = Clock()
    ev = EvalLog(clock)
    said = []
    for t, done in [
        (0, 0),
        (3, 16),
        (EVAL_LINE_S + 1, 32),
        (EVAL_LINE_S + 2, 48),
        (2 * EVAL_LINE_S + 2, 64),
        (99, 128),
    ]:
        clock.t = t
        said.append(ev.due(6, done, 128))
    assert said == [True, False, True, False, True, False] and EVAL_LINE_S <= 10


def test_slow_steps_state_the_end_after_a_minute_not_after_ten_steps():
    clock = Clock()
    log = TrainLog(1, 100, 100, 2, clock)
    etas = []
    for s in range(51, 56):
        clock.t += 40.0
        log.step(s)
        etas.append(log.eta(s))
    assert etas[:2] == [None, None] and etas[2] is not None and etas[3:] == [None, None]  # at 80 s, 3 steps
    assert etas[2].startswith("epoch 1: 0.025 steps/s; it should end (step 100) at about ")
    assert etas[2].endswith("(in 31 min); evaluations and exports come after")  # no run's end: the last epoch


def test_the_eval_worker_reports_the_prompts_done(tmp_path):
    """Evaluation streams its progress: prompts done of all its passes (greedy, then sampled)."""
    from tasks.process import run_worker
    from tests.test_worker import make_run

    root = make_run(str(tmp_path), "evalprog", eval={"num_samples": 2, "batch_size": 4})  # 8 rows: 2 batches a pass
    events = []
    args = ["grpo_core.stages.worker", "eval", "--root", root, "--steps", "0"]
    run_worker(args, timeout_s=240, on_event=events.append, what="evaluation")
    shown = [(e["step"], e["done"], e["total"]) for e in events if e["event"] == "eval_progress"]
    assert shown == [(0, 0, 16), (0, 4, 16), (0, 8, 16), (0, 12, 16), (0, 16, 16)]
    assert {(e["rows"], e["passes"]) for e in events if e["event"] == "eval_progress"} == {(8, 2)}  # the bar says so
    assert [e["event"] for e in events][-1] == "eval"  # the result after its progress


# -- grpo run in a terminal and in a pipe ----------------------------------------------------------

STEPS = 30
ARGS = ["--set", f"train.num_steps={STEPS}", "--set", "pipeline.epochs=1", "--set", "pipeline.checkpoint_every=10"]


def _grpo_run(tmp_path, terminal: bool) -> str:
    """`grpo run` (a real process) with its stdout and stderr a terminal (a pty) or a pipe; its output."""
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ, PREFECT_API_URL=PREFECT_API_URL.value(), COLUMNS="120", TERM="xterm")
    cmd = [sys.executable, "-m", "flows.cli", "run", "--set", f"storage.root={tmp_path}/runs", *ARGS]
    if not terminal:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout + out.stderr
    leader, follower = pty.openpty()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=env, cwd=ROOT)
    os.close(follower)
    chunks, deadline = [], time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            if select.select([leader], [], [], 1.0)[0]:
                try:
                    chunk = os.read(leader, 1 << 16)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            elif proc.poll() is not None:
                break
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
    out = b"".join(chunks).decode(errors="replace")
    assert proc.wait(timeout=60) == 0, ANSI.sub("", out)[-3000:]
    return out


@pytest.mark.slow  # end to end: a whole `grpo run` in a terminal (~30 s with its server); make test runs it
@pytest.mark.usefixtures("prefect_server")
def test_grpo_run_in_a_terminal_shows_bars_for_steps_and_evaluation(tmp_path):
    out = _grpo_run(tmp_path, terminal=True)
    plain = ANSI.sub("", out)
    assert "\x1b[2K" in out  # rich redraws its bars in place
    # the training bar: steps done of the run's, steps/s and the time left
    assert re.search(rf"training +\S+ +{STEPS}/{STEPS} +steps +[0-9.]+ steps/s ETA", plain), plain[-3000:]
    # each evaluation's bar: prompts done of its passes (128 eval rows, greedy and 4 samples)
    assert re.search(r"eval step 0 \(2 passes × 128 prompts: greedy, then sampled\) +\S+ +\d+/256 +prompts", plain)
    assert re.search(r"eval step 30 ", plain)
    # and Prefect's log keeps its lines, the expected end among them
    assert re.search(r"epoch 0: [0-9.]+ steps/s; it should end \(step 30\) at about \d\d:\d\d", plain)
    assert f"step {STEPS}/{STEPS}" in plain and "eval step 30: accuracy" in plain


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_grpo_run_in_a_pipe_draws_no_bar(tmp_path):
    out = _grpo_run(tmp_path, terminal=False)
    assert "\x1b[" not in out and "━" not in out and "steps/s ETA" not in out
    assert re.search(r"epoch 0: [0-9.]+ steps/s; it should end \(step 30\) at about \d\d:\d\d", out)
    assert f"step {STEPS}/{STEPS}" in out and "eval step 30: accuracy" in out
