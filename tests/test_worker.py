"""The worker as a real process: JSON-line progress, SIGKILL mid-run, exact resume, eval."""

import json
import os
import select
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from grpo_core.config.run import RunConfig
from grpo_core.data.prepare import prepare_dataset
from grpo_core.data.tokenizer import make_tokenizer
from grpo_core.rl.checkpoint import Checkpointer
from grpo_core.store.root import RunRoot
from grpo_core.store.runs import init_run_root

pytestmark = pytest.mark.slow


def make_run(root: str, name: str, **extra) -> str:
    """A run folder as the pipeline leaves it before training: config.json and prepared data."""
    cfg = RunConfig.from_dict(
        {
            "run_name": name,
            "storage": {"root": root},
            "data": {"eval_rows": 8, "synthetic_rows": 64},
            "train": {"num_steps": 6, "grpo": {"prompts_per_step": 4}, "optimizer": {"learning_rate": 1e-2}},
            "eval": {"num_samples": 2},
            "pipeline": {"checkpoint_every": 2},
            **extra,
        }
    )
    run = init_run_root(cfg)
    prepare_dataset(cfg.data, make_tokenizer(cfg), run, cfg.tokenizer_id)
    return cfg.run_url


def worker(root, until=None, steps=None, env=None, then=()):
    args = ["train", "--until-step", str(until)] if steps is None else ["eval", "--steps", steps]
    return subprocess.Popen(
        [sys.executable, "-m", "grpo_core.stages.worker", *args, *then, "--root", root],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=None if env is None else {**os.environ, **env},
    )


def events(proc):
    """The worker's events after the memory plan a training worker reports first, without the
    evaluation's progress (tests/test_progress.py)."""
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    ev = [e for e in map(json.loads, out.splitlines()) if e["event"] != "eval_progress"]
    if ev and ev[0]["event"] == "memory":
        assert ev[0]["total_bytes"] > 0 and ev[0]["fits"] and "train.remat=" in ev[0]["describe"]
        ev = ev[1:]
    return ev


def final_params(root, step=6):
    with Checkpointer(RunRoot(root).uri("checkpoints")) as ckpt:
        state, meta = ckpt.restore(step)
    assert meta["step"] == step
    return state["params"]


def test_kill_resume_equals_uninterrupted(tmp_path):
    straight = make_run(str(tmp_path), "straight")
    ev = events(worker(straight, 6))
    assert ev[0] == {"event": "start", "step": 0, "until": 6}
    assert [e["step"] for e in ev if e["event"] == "checkpoint"] == [2, 4, 6]
    assert ev[-1] == {"event": "done", "step": 6, "steps_run": 6}

    killed = make_run(str(tmp_path), "killed")
    proc = worker(killed, 6)
    seen = []
    for line in proc.stdout:  # kill after the checkpoint at 2, in the middle of steps 3..4
        seen.append(json.loads(line))
        if seen[-1]["event"] == "step" and seen[-1]["step"] == 2:
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    ev = events(worker(killed, 6))
    assert ev[0] == {"event": "resumed", "step": 2, "until": 6}
    assert ev[-1] == {"event": "done", "step": 6, "steps_run": 4}

    a, b = RunRoot(straight).read_metrics(), RunRoot(killed).read_metrics()
    assert [r["step"] for r in b] == list(range(6))  # none missing, none doubled
    for x, y in zip(a, b):
        assert y["reward"] == pytest.approx(x["reward"], abs=1e-6) and y["loss"] == pytest.approx(
            x["loss"], rel=1e-4, abs=1e-7
        )
    jax.tree.map(
        lambda p, q: np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6),
        final_params(straight),
        final_params(killed),
    )


def test_epoch_boundary_and_finished_runs(tmp_path):
    root = make_run(str(tmp_path), "epochs")
    assert events(worker(root, 4))[-1]["steps_run"] == 4
    ev = events(worker(root, 6))  # resumed exactly at the boundary: trains 4 and 5
    assert ev[0]["event"] == "resumed" and [e["step"] for e in ev if e["event"] == "step"] == [4, 5]
    ev = events(worker(root, 6))  # finished: no training at all
    assert [e["event"] for e in ev] == ["resumed", "done"] and ev[-1]["steps_run"] == 0

    ev = events(worker(root, steps="0,6"))
    assert [(e["step"], e["cached"]) for e in ev] == [(0, False), (6, False)]
    stored = RunRoot(root).read_json("eval/6.json")
    assert 0 <= stored["accuracy"] <= 1 and set(stored) >= {"pass@1", "pass@2", "greedy", "sampled", "examples"}
    ev = events(worker(root, steps="6"))  # evaluated with the same config: read back
    assert ev[0]["cached"] is True and ev[0]["accuracy"] == stored["accuracy"]


def test_the_evaluations_programs_compile_while_the_worker_trains(tmp_path):
    """GRPO_EVAL_AHEAD=1 (the default on a TPU): train --then-eval compiles the
    evaluation's sampler programs (greedy, sampled, the examples) in a thread while it trains, for
    the policy laid out as the evaluation lays it out: each evaluation then compiles nothing, and
    scores as one that compiled for itself. On a mesh of 2 devices (the evaluation's weights laid
    out over it) it compiles no sampler program either, only the moves of the weights onto it."""
    evals = {}
    two = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"}
    for name, env in (("ahead", {"GRPO_EVAL_AHEAD": "1"}), ("not", {"GRPO_EVAL_AHEAD": "0"}), ("mesh", two)):
        root = make_run(str(tmp_path), name)
        env = {"GRPO_EVAL_AHEAD": "1", **env}
        ev = events(worker(root, 2, env=env, then=("--then-eval", "0,2")))
        evals[name] = [e for e in ev if e["event"] == "eval"]
        assert [(e["step"], e["cached"]) for e in evals[name]] == [(0, False), (2, False)]
    assert [(e["programs_compiled"], e["compile_s"]) for e in evals["ahead"]] == [([], 0.0), ([], 0.0)]
    assert [e["devices"] for e in evals["mesh"]] == [2, 2]
    sampler = lambda e: [p for p in e["programs_compiled"] if "prefill" in p or "decode" in p]
    assert [sampler(e) for e in evals["mesh"]] == [[], []], evals["mesh"][0]["programs_compiled"]
    # compiled, or read from the compilation cache, at the first evaluation: greedy, sampled, examples
    assert len(sampler(evals["not"][0])) >= 6 and evals["not"][0]["compile_s"] > 0
    scores = lambda e: {k: e[k] for k in ("accuracy", "greedy", "sampled", "examples", "pass@1", "pass@2")}
    assert [scores(e) for e in evals["ahead"]] == [scores(e) for e in evals["not"]]


def test_error_exit_codes(tmp_path):
    root = make_run(str(tmp_path), "r")
    proc = worker(root, 99)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert json.loads(out.splitlines()[-1]) == {
        "event": "error",
        "kind": "config",
        "message": "--until-step 99 is past train.num_steps (6)",
    }
    proc = worker(root, steps="4")  # no such checkpoint
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "no checkpoint for step 4" in json.loads(out.splitlines()[-1])["message"]
    proc = worker(str(tmp_path / "not-a-run"), 2)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "config.json does not exist" in out


def test_reward_error_exit_code(tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text(
        "def boom(prompts, completions, answer, **kw):\n"
        "    return [0.0 if c == '#' else 1 / 0 for c, a in zip(completions, answer)]\n"
    )
    root = make_run(str(tmp_path), "r", rewards=[{"function": f"{bad}:boom"}])
    proc = worker(root, 2)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3
    err = json.loads(out.splitlines()[-1])
    assert (
        err["kind"] == "reward" and "'boom' raised ZeroDivisionError" in err["message"] and "on row" in err["message"]
    )


def test_the_training_worker_trains_with_the_update_its_compiler_fits(tmp_path):
    """train.remat and grad_accum_steps at auto, the device's memory known (GRPO_DEVICE_MEMORY_BYTES
    sets a budget on the CPU backend, as an accelerator's bytes_limit does): the worker compiles
    the candidate updates for its devices, cheapest first, and trains with the first whose XLA peak
    fits. With room to spare that is the cheapest (dots, no accumulation); with a budget one byte
    short of its figure the worker passes it over, reading its figures back from the cache that
    the first worker filled, and trains with the next that fits. The memory plan it reports, and
    trains with, is the compiler's choice."""
    from grpo_core.rl.aot import HEADROOM

    def run(name, budget):
        proc = worker(
            make_run(str(tmp_path), name),
            1,
            env={"GRPO_DEVICE_MEMORY_BYTES": str(budget), "GRPO_AOT_CACHE_DIR": str(tmp_path / "aot-cache")},
        )
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        ev = [json.loads(line) for line in out.splitlines()]
        assert [e["event"] for e in ev[:3]] == ["memory_xla", "memory", "start"] and ev[-1]["event"] == "done"
        choice, plan = ev[0], ev[1]
        assert choice["source"] == "xla" and choice["backend"] == "cpu" and choice["budget_bytes"] == budget
        assert f"train.remat={choice['remat']}" in plan["describe"]
        assert f"train.grpo.grad_accum_steps={choice['grad_accum_steps']}" in plan["describe"]
        return choice

    roomy = run("roomy", 2**40)
    first = roomy["candidates"][0]
    assert (roomy["remat"], roomy["grad_accum_steps"]) == ("dots", 1) and len(roomy["candidates"]) == 1
    assert first["fits"] and not first["cached"] and first["xla_peak_bytes"] > 0

    tight = run("tight", int((first["peak_bytes"] - 1) / HEADROOM))
    passed_over = tight["candidates"][0]
    assert (passed_over["remat"], passed_over["grad_accum_steps"]) == ("dots", 1)
    assert passed_over["cached"] and not passed_over["fits"] and passed_over["peak_bytes"] == first["peak_bytes"]
    assert tight["fits"] and tight["peak_bytes"] <= tight["usable_bytes"]
    assert (tight["remat"], tight["grad_accum_steps"]) != ("dots", 1)
    assert all(not c["fits"] for c in tight["candidates"][:-1]) and tight["candidates"][-1]["fits"]
    # the line the train task logs for the event
    line = tight["describe"]
    assert line.startswith(f"XLA (cpu) chose train.remat={tight['remat']}, train.grpo.grad_accum_steps=")
    assert "candidates: dots/1 " in line and "(does not fit)" in line


def test_the_next_stage_runs_in_the_worker_that_stayed(tmp_path):
    """A stage that knows another follows (run_worker next_stage=True: an epoch before the last)
    runs in a worker that stays: once the stage ended well the process waits, parked, and the next
    stage's run_worker hands it its command line. It runs that stage as a fresh worker would
    (resumed from the newest checkpoint, the same events), with JAX up and its programs compiled.
    A stage with another environment gets a fresh worker and the parked one is stopped; the last
    stage's worker exits; nothing is left running."""
    from grpo_core.launch import launchers
    from tasks import process

    root = make_run(str(tmp_path), "stays")
    args = lambda until: ["grpo_core.stages.worker", "train", "--root", root, "--until-step", str(until)]
    steps = lambda events: [e["step"] for e in events if e["event"] == "step"]
    pids = []

    def on_event(e):
        if e["event"] in ("start", "resumed"):
            pids.extend(launched.procs[0].pid for launched in process._LIVE.values())

    first = process.run_worker(args(2), timeout_s=300, on_event=on_event, what="epoch 0", next_stage=True)
    assert steps(first) == [0, 1] and first[-1] == {"event": "done", "step": 2, "steps_run": 2}
    assert not any(e["event"] == "stage_end" for e in first)
    [(_, stayed)] = launchers._AHEAD.values()
    assert stayed.poll() is None and pids == [stayed.pid]  # its stage done, waiting for the next

    second = process.run_worker(args(4), timeout_s=300, on_event=on_event, what="epoch 1", next_stage=True)
    assert pids == [stayed.pid] * 2 and stayed.poll() is None
    assert second[0]["event"] == "memory" and second[1] == {"event": "resumed", "step": 2, "until": 4}
    assert steps(second) == [2, 3] and second[-1] == {"event": "done", "step": 4, "steps_run": 2}

    third = process.run_worker(args(5), timeout_s=300, on_event=on_event, what="epoch 2")  # the last: it exits
    assert steps(third) == [4] and pids == [stayed.pid] * 3 and stayed.wait(timeout=60) == 0
    assert not launchers._AHEAD

    process.run_worker(args(5), timeout_s=300, on_event=lambda e: None, what="epoch 2 again", next_stage=True)
    [(_, other)] = launchers._AHEAD.values()  # a fresh worker that stays (its stage was already trained)
    fourth = process.run_worker(args(6), timeout_s=300, on_event=on_event, what="epoch 3", env={"GRPO_X": "1"})
    assert steps(fourth) == [5] and other.returncode == -signal.SIGKILL and not launchers._AHEAD
    assert pids[-1] not in (stayed.pid, other.pid)
    assert final_params(root)  # the run is whole: checkpoint 6 restores


def test_a_stage_in_a_worker_that_stayed_trains_as_in_a_fresh_one(tmp_path):
    """The same epochs, each in a process of its own and all in one process that stays: the
    same checkpoint, bit for bit."""
    from tasks import process

    params = []
    for name, stay in (("fresh", False), ("stayed", True)):
        root = make_run(str(tmp_path), name)
        for until in (2, 4, 6):
            args = ["grpo_core.stages.worker", "train", "--root", root, "--until-step", str(until)]
            process.run_worker(args, timeout_s=300, on_event=lambda e: None, what=name, next_stage=stay and until < 6)
        params.append(final_params(root))
    jax.tree.map(np.testing.assert_array_equal, *params)


def test_the_first_stage_trains_in_the_process_that_checked_its_devices(tmp_path, monkeypatch):
    """The pipeline's readiness (handover) runs the device checks in the worker started ahead for
    the first training stage: ready, that process trains the stage; not ready, or past the checks'
    time limit, it is stopped (the limit a retryable StageError, as a check process of its own)."""
    from grpo_core.launch import launchers
    from tasks import process, readiness
    from tasks.process import StageError

    started = []
    real = readiness.start_ahead
    monkeypatch.setattr(readiness, "start_ahead", lambda *a, **kw: started.append(real(*a, **kw)) or started[-1])
    root = make_run(str(tmp_path), "checked")
    raw = RunRoot(root).read_json("config.json")
    cfg = RunConfig.from_dict(raw)

    report = readiness.readiness_report(cfg, handover=True)
    assert report["ready"] and report["backend"] == "cpu", report
    assert [c["name"] for c in report["checks"]][:4] == ["tokenizer", "storage", "run", "tpu_lockfile"]
    [(_, checked)] = launchers._AHEAD.values()
    assert started == [checked] and checked.poll() is None  # ready: waits for its stage, backend up
    running = []

    def on_event(e):
        if e["event"] == "resumed" or e["event"] == "step" and not running:
            running.extend(launched.procs[0].pid for launched in process._LIVE.values())

    args = ["grpo_core.stages.worker", "train", "--root", root, "--until-step", "2"]
    events = process.run_worker(args, timeout_s=300, on_event=on_event, what="epoch 0")
    assert running == [checked.pid] and checked.returncode == 0 and not launchers._AHEAD
    assert [e["step"] for e in events if e["event"] == "step"] == [0, 1]

    tpu_only = RunConfig.from_dict(dict(raw, pipeline=dict(raw["pipeline"], require_tpu=True)))
    not_ready = readiness.readiness_report(tpu_only, handover=True)
    failed = [c["name"] for c in not_ready["checks"] if not c["ok"]]
    assert not not_ready["ready"] and failed == ["tpu_required"], not_ready
    assert started[-1].returncode is not None and not launchers._AHEAD  # nothing waits for a stage

    with pytest.raises(StageError, match="did not finish within 0.3 s") as exc:
        readiness.readiness_report(cfg, timeout_s=0.3, handover=True)  # no interpreter imports JAX that fast
    assert exc.value.retryable and started[-1].returncode == -signal.SIGKILL and not launchers._AHEAD


def test_the_checks_before_a_stage_never_stall_on_a_stderr_nobody_reads():
    """A worker started ahead runs the readiness checks with its stderr piped to a task that reads
    it only once a stage takes the process: what the checks write there (a backend's start-up
    logs) goes aside, so 15 pipes' worth still lets the report out; a check that crashes still
    says why on stderr."""
    code = (
        "import os, sys\n"
        "from grpo_core.stages.ahead import stderr_aside\n"
        "with stderr_aside():\n"
        "    os.write(2, b'x' * 1_000_000)\n"
        "print('checked', flush=True)\n"
        "sys.stdin.readline()\n"
        "with stderr_aside():\n"
        "    print('the backend said this', file=sys.stderr)\n"
        "    raise RuntimeError('the check crashed')\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert select.select([proc.stdout], [], [], 60)[0], "stalled on its stderr"
        assert proc.stdout.readline() == "checked\n"
        _, err = proc.communicate("go\n", timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1 and "xxxx" not in err
    assert "the backend said this" in err and "RuntimeError: the check crashed" in err


def test_a_worker_started_ahead_ends_with_the_process_that_started_it(tmp_path):
    """kill -9 of the process that started a worker ahead (the CLI, a Prefect worker) leaves
    nothing running: the worker ahead reads the end of its stdin and exits."""
    code = (
        "import sys, time\n"
        "from grpo_core.launch import launchers\n"
        "launchers.start_ahead(None)\n"
        "print(launchers._AHEAD[''][1].pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 60
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie has exited; it only waits to be reaped
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


CACHE_CHECK = """
import jax
from grpo_core.stages.worker import _compilation_cache
_compilation_cache()
print(jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
if "://" not in jax.config.jax_compilation_cache_dir:
    jax.block_until_ready(jax.random.normal(jax.random.key(0), (3, 5)))  # op by op, each a small program
"""


@pytest.mark.parametrize("folder", ["local", "gs://bucket/jax"])
def test_a_local_compilation_cache_keeps_every_program_a_remote_one_the_slow_ones(tmp_path, folder):
    """The worker's compilation cache: in a local folder even the eager initialisers' tiny
    programs (loading them costs less than compiling them); in a bucket only programs that took
    0.1 s or more to compile (a read there costs more than a small compile)."""
    where = str(tmp_path / "jax") if folder == "local" else folder
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=where)
    env.pop("GRPO_COMPILATION_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", CACHE_CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [where, "0.0" if folder == "local" else "0.1"]
    if folder == "local":
        assert len(os.listdir(where)) >= 3  # the draw's programs, each under 0.1 s to compile
