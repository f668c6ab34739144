"""Asynchronous rollouts (grpo_core.rl.overlap): train.max_staleness k and train.rollout.layout.

k = 0 is the run as it was before (pinned to the base commit's bytes); with k >= 1 the batch of
step s is drawn by version max(0, s - k), in a thread (colocated) or a second process (split), and
a worker SIGKILLed with rollouts in flight resumes to the bytes of an uninterrupted run. The split
layout's process never outlives its worker: a kill, a Ctrl-C, a failure of either side."""

import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from grpo_core.config.fields import config_hash
from grpo_core.config.run import DEFAULT, RunConfig
from grpo_core.config.train import TrainConfig
from grpo_core.errors import ConfigError, ExitCode
from grpo_core.generate.types import Completions
from grpo_core.rl import overlap
from grpo_core.rl.checkpoint import AHEAD, Checkpointer
from grpo_core.rl.rollouts import Rollout
from grpo_core.store.root import RunRoot
from tests.faults import HOOK
from tests.test_worker import make_run, worker

PINNED = os.path.join(os.path.dirname(__file__), "pinned", "sync_run_base.json")


def train_section(k: int, layout: str = "colocated", **grpo) -> dict:
    return {
        "num_steps": 6,
        "max_staleness": k,
        "rollout": {"layout": layout},
        "grpo": {"prompts_per_step": 4, **grpo},
        "optimizer": {"learning_rate": 1e-2},
    }


def digest(root: str, step: int = 6) -> dict:
    """A run's metrics (every value but timings and memory, as exact hex floats) and the sha256 of
    its parameters at `step`: equal digests are the same bytes."""
    rows = RunRoot(root).read_metrics()
    keep = lambda k: not k.startswith(("time/", "async/")) and k != "rollout_tokens_per_s" and "peak" not in k
    rows = [{k: float(v).hex() for k, v in sorted(r.items()) if keep(k)} for r in rows]
    with Checkpointer(RunRoot(root).uri("checkpoints")) as ckpt:
        state, _ = ckpt.restore(step)
    h = hashlib.sha256()
    leaves = jax.tree_util.tree_leaves_with_path(state["params"])
    for path, leaf in sorted(leaves, key=lambda x: jax.tree_util.keystr(x[0])):
        h.update(jax.tree_util.keystr(path).encode())
        h.update(np.asarray(leaf).tobytes())
    return {"metrics": rows, "params_sha256": h.hexdigest()}


def run_events(proc, code: int = 0) -> tuple[list[dict], str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err[-3000:]
    return [json.loads(line) for line in out.splitlines()], err


def gone(pid: int, within_s: float = 60) -> bool:
    """Whether process `pid` has ended (or is a zombie) within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.2)
    return False


# -- the schedule, the config, the saved batches ---------------------------------------------------


def test_the_lag_is_fixed_and_k0_hashes_as_before():
    assert [overlap.version_of(s, 2) for s in range(6)] == [0, 0, 0, 1, 2, 3]
    assert [overlap.version_of(s, 0) for s in range(3)] == [0, 1, 2]
    # hashes recorded on the base commit, before the fields existed: k = 0 keeps them
    d = dict(DEFAULT, storage={"root": "/tmp/x"})
    assert RunConfig.from_dict(d).train_hash == "ecc6c5c954ea"
    assert config_hash(TrainConfig().hash_fields()) == "49e94e2e8b84"
    one = TrainConfig(max_staleness=1)
    assert config_hash(one.hash_fields()) != "49e94e2e8b84"
    # where the rollout runs changes no result: a run may resume in the other layout
    split = TrainConfig(max_staleness=1, rollout={"layout": "split", "devices": 1})
    assert config_hash(split.hash_fields()) == config_hash(one.hash_fields())


def test_other_engines_and_bad_values_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match="train.max_staleness must be >= 0, got -1"):
        TrainConfig(max_staleness=-1)
    with pytest.raises(ConfigError, match="train.rollout.layout must be one of colocated, split"):
        TrainConfig(rollout={"layout": "remote"})
    with pytest.raises(ConfigError, match=r"max_staleness=1 .*\(train.rollout.engine=jax\) for now, got engine=http"):
        TrainConfig(max_staleness=1, rollout={"engine": "http", "server": "sglang-jax"})
    with pytest.raises(ConfigError, match="layout=split .*got engine=sglang"):
        TrainConfig(rollout={"engine": "sglang", "layout": "split"})


def made(step: int, version: int, episode: bool) -> overlap.Made:
    rng = np.random.default_rng(step)
    b, n = 4, 3
    c = Completions(
        tokens=rng.integers(0, 9, (b, n)).astype(np.int32),
        logprobs=rng.normal(size=(b, n)).astype(np.float32),
        lengths=np.asarray([3, 1, 2, 3], np.int32),
        truncated=np.asarray([True, False, False, True]),
        trained=(rng.random((b, n)) > 0.5) if episode else None,
    )
    ro = Rollout(
        rows=[{"prompt": "ab", "prompt_ids": [1, 2]}, {"prompt": "c", "answer": 3}],
        prompt_tokens=np.asarray([[1, 2], [0, 3]], np.int32),
        prompt_valid=np.asarray([[True, True], [False, True]]),
        completions=c,
        texts=["x", "y", "", "é"],
        rewards=np.asarray([0.5, np.nan, 1.0, 0.0]),
        per_function={"char/match": np.asarray([0.5, np.nan, 1.0, 0.0]), "b": np.float32([1, 2, 3, 4])},
        episode={"turns": np.ones(b), "tools/look up/calls": np.arange(b, dtype=np.float64)} if episode else None,
        tool_seconds=0.25 if episode else 0.0,
    )
    info = {"sampling_rounds": 2.0, "frac_reward_zero_std": 0.1 + step, "rollout_tokens": 9.0}
    seconds = {"rollout": 0.1, "rewards": 0.2, "score": 0.0, "wait": 1 / 3}
    return overlap.Made(
        step, version, ro, info, seconds, rng.normal(size=(b, n)).astype(np.float32) if episode else None
    )


def test_batches_ahead_round_trip_through_a_checkpoint_exactly(tmp_path):
    batches = [made(4, 2, episode=True), made(5, 3, episode=False)]
    with Checkpointer(str(tmp_path / "ck")) as ckpt:
        ckpt.save(4, {"w": np.ones(2, np.float32)}, {"seed": 0}, ahead=overlap.to_saved(batches))
        ckpt.save(6, {"w": np.ones(2, np.float32)}, {"seed": 0})
        ckpt.wait()
        _, meta = ckpt.restore(4, {"w": np.ones(2, np.float32)})
        _, plain = ckpt.restore(6, {"w": np.ones(2, np.float32)})
    assert AHEAD not in plain  # a checkpoint without batches ahead (every synchronous one) restores as before
    back = overlap.from_saved(*meta[AHEAD])
    for a, b in zip(batches, back):
        assert (a.step, a.version, a.info, a.seconds) == (b.step, b.version, b.info, b.seconds)
        x, y = a.rollout, b.rollout
        assert (x.texts, x.rows, x.tool_seconds) == (y.texts, y.rows, y.tool_seconds)
        same = lambda p, q: (p is None and q is None) or (p.dtype == q.dtype and p.tobytes() == q.tobytes())
        assert all(same(p, q) for p, q in zip(x.completions, y.completions))
        assert same(x.prompt_tokens, y.prompt_tokens) and same(x.prompt_valid, y.prompt_valid)
        assert same(x.rewards, y.rewards) and same(a.behaviour_logp, b.behaviour_logp)
        assert list(x.per_function) == list(y.per_function)
        assert all(same(x.per_function[k], y.per_function[k]) for k in x.per_function)
        assert (x.episode is None) == (y.episode is None)
        assert x.episode is None or all(same(x.episode[k], y.episode[k]) for k in x.episode)


def test_a_checkpoint_without_the_batches_ahead_is_refused():
    side = overlap.Colocated.__new__(overlap.Colocated)
    overlap._Ahead.__init__(side, 2)
    assert side.first_to_draw(0, [], end=6) == 0  # step 0: version 0 draws steps 0 and 1
    side.inbox = overlap.Inbox()
    assert side.first_to_draw(3, [made(3, 1, False), made(4, 2, False)], end=6) == 5
    with pytest.raises(ValueError, match=r"holds the batches drawn ahead of steps \[\], but .* steps \[3, 4\]"):
        side.first_to_draw(3, [], end=6)
    assert side.first_to_draw(6, [], end=6) == 6  # the run's end: nothing ahead


# -- runs of the worker ----------------------------------------------------------------------------


@pytest.mark.slow
def test_k0_is_the_base_commits_run_to_the_byte(tmp_path):
    """The synchronous run (k = 0, colocated: the default) gives the metrics and parameters the
    base commit gave, bit for bit (tests/pinned: recorded there with the tests' XLA flags)."""
    pinned = json.load(open(PINNED))
    rec = pinned["recorded_with"]
    here = {"jax": jax.__version__, "machine": platform.machine(), "avx512f": "avx512f" in open("/proc/cpuinfo").read()}
    if any(rec[k] != v for k, v in here.items()):  # XLA:CPU's code and its bits follow the host's vector units
        pytest.skip(f"the pinned bytes were recorded with {rec}, this host is {here}: record them again on the base")
    variants = {"plain": {}, "dynamic_iter2": {"dynamic_sampling": True, "num_iterations": 2}}
    for name, grpo in variants.items():
        train = train_section(0, **grpo)
        del train["max_staleness"], train["rollout"]  # the config as the base commit wrote it
        root = make_run(str(tmp_path), name, train=train)
        run_events(worker(root, 6))
        assert digest(root) == pinned["runs"][name], name


@pytest.mark.slow
@pytest.mark.parametrize("layout,k", [("split", 2), ("colocated", 1)])
def test_kill_with_rollouts_in_flight_resumes_to_the_same_bytes(tmp_path, layout, k):
    """SIGKILL after steps 0..3 ran, with rollouts in flight (the checkpoint at 2 holds the batches of
    steps 2 .. 2+k-1, drawn by versions it does not hold), resumed: the bytes of the uninterrupted
    run with the same k. The batch of step s comes from version max(0, s - k), and the split
    process dies with its worker."""
    straight = make_run(str(tmp_path), "straight", train=train_section(k, layout))
    ev, _ = run_events(worker(straight, 6))
    steps = [e for e in ev if e["event"] == "step"]
    assert [e["async/version"] for e in steps] == [max(0, s - k) for s in range(6)]
    assert [e["async/staleness"] for e in steps] == [min(s, k) for s in range(6)]
    side = next(e for e in ev if e["event"] == "rollout_side")
    assert (side["layout"], side["max_staleness"]) == (layout, k)

    killed = make_run(str(tmp_path), "killed", train=train_section(k, layout))
    env = {"GRPO_TEST_HOOK": HOOK, "GRPO_FAULT": f"step:4:{tmp_path / 'fired'}"}  # 4 steps done, no checkpoint
    ev, _ = run_events(worker(killed, 6, env=env), code=-signal.SIGKILL)
    assert [e["step"] for e in ev if e["event"] == "checkpoint"] == [2]
    assert "ahead" in RunRoot(killed).list("checkpoints/2")  # the batches of steps 2 .. 2+k-1, with it
    if layout == "split":
        pid = next(e["pid"] for e in ev if e["event"] == "rollout_side")
        assert gone(pid), "the rollout process outlived its SIGKILLed worker"
    ev, _ = run_events(worker(killed, 6, env=env))
    assert ev[1]["event"] == "resumed" and ev[1]["step"] == 2
    resumed = [e for e in ev if e["event"] == "step"]
    assert [e["async/version"] for e in resumed] == [max(0, s - k) for s in range(2, 6)]
    assert digest(killed) == digest(straight)


def first_step_then(proc, step: int, act) -> list[dict]:
    """Read the worker's events until step `step`'s, then `act(events)`; the events read."""
    seen = []
    for line in proc.stdout:
        seen.append(json.loads(line))
        if seen[-1]["event"] == "step" and seen[-1]["step"] == step:
            act(seen)
            break
    return seen


@pytest.mark.slow
def test_the_split_process_never_outlives_a_stop_or_a_failure(tmp_path):
    """Ctrl-C (SIGINT to the worker): a checkpoint at the step boundary with the batches the
    rollout process drew, the process stopped, and the run resumes to the uninterrupted bytes. The
    rollout process SIGKILLed: the worker fails with exit 7 (retried) naming it, and a retry resumes
    to the same bytes. A reward function that raises in the rollout process: exit 3 (not retried),
    the message names the function and the process. In every case no rollout process is left."""
    train = train_section(1, "split")
    straight = make_run(str(tmp_path), "straight", train=train)
    run_events(worker(straight, 6))

    stopped = make_run(str(tmp_path), "stopped", train=train)
    proc = worker(stopped, 6)
    seen = first_step_then(proc, 1, lambda _: os.kill(proc.pid, signal.SIGINT))
    rest, _ = run_events(proc, code=ExitCode.INTERRUPTED)
    ev = seen + rest
    pid = next(e["pid"] for e in ev if e["event"] == "rollout_side")
    saved = [e["step"] for e in ev if e["event"] == "checkpoint"]
    assert saved and saved[-1] < 6 and gone(pid)
    assert "ahead" in RunRoot(stopped).list(f"checkpoints/{saved[-1]}")
    ev, _ = run_events(worker(stopped, 6))
    assert ev[1] == {"event": "resumed", "step": saved[-1], "until": 6}
    assert digest(stopped) == digest(straight)
    ev, _ = run_events(worker(stopped, 6))  # finished: its rollout process starts and stops, drawing nothing
    side = next(e for e in ev if e["event"] == "rollout_side")
    assert ev[-1] == {"event": "done", "step": 6, "steps_run": 0} and gone(side["pid"])
    assert not os.path.exists(side["log"]) and rollout_processes(stopped) == []  # a clean end keeps no log

    lost = make_run(str(tmp_path), "lost", train=train)
    env = {"GRPO_TEST_HOOK": HOOK, "GRPO_FAULT": f"rollout:3:{tmp_path / 'rollout-killed'}"}
    ev, _ = run_events(worker(lost, 6, env=env), code=ExitCode.ROLLOUT)
    pid = next(e["pid"] for e in ev if e["event"] == "rollout_side")
    error = ev[-1]
    assert error["event"] == "error" and error["kind"] == "rollout"
    assert f"the rollout process (pid {pid}, python -m grpo_core.stages.rollout" in error["message"]
    assert "was killed by SIGKILL" in error["message"]
    log = error["message"].split("its log ", 1)[1].split(")", 1)[0]
    assert os.path.exists(log)  # kept: its learner failed
    ev, _ = run_events(worker(lost, 6, env=env))  # the retry resumes
    assert ev[1]["event"] == "resumed" and digest(lost) == digest(straight)
    assert not os.path.exists(log)  # the next split stage swept the log of a learner that is gone

    boom = tmp_path / "boom.py"
    boom.write_text(
        "def boom(prompts, completions, trainer_state, **kw):\n"
        "    if trainer_state.global_step == 3:\n"
        "        raise ValueError('no reward at step 3')\n"
        "    return [float(len(c)) for c in completions]\n"
    )
    failing = make_run(str(tmp_path), "failing", train=train, rewards=[{"function": f"{boom}:boom"}])
    ev, _ = run_events(worker(failing, 6), code=ExitCode.REWARD)
    pid = next(e["pid"] for e in ev if e["event"] == "rollout_side")
    assert ev[-1]["kind"] == "reward" and "'boom' raised ValueError" in ev[-1]["message"]
    assert "(in the rollout process (pid" in ev[-1]["message"] and gone(pid)


def rollout_processes(run_url: str) -> list[int]:
    """Live rollout processes reading this run (their command line names it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"grpo_core.stages.rollout" in argv and run_url.encode() in argv and not gone(int(pid), 0.1):
            found.append(int(pid))
    return found


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_the_pipeline_retries_a_failed_rollout_process_and_resumes(tmp_path, monkeypatch):
    """The pipeline with the split layout (k = 1) over two epochs: its rollout process SIGKILLed after
    step 2 fails the epoch's task with exit 7 naming the process, the retry resumes; the worker
    SIGKILLed after step 5 (rollouts in flight) is retried and resumes too. The run ends with the
    bytes of an uninterrupted worker's, the rollout side in its logs and artifacts, and no rollout
    process left."""
    from prefect.client.orchestration import get_client

    from flows.pipeline import grpo_pipeline
    from tests.test_deployments import wait_logs
    from tests.test_pipeline import artifacts, small_config, task_runs

    train = train_section(1, "split")
    straight = make_run(str(tmp_path), "straight", train=train)
    run_events(worker(straight, 6))

    monkeypatch.setenv("GRPO_TEST_HOOK", HOOK)
    monkeypatch.setenv("GRPO_FAULT", f"rollout:2:{tmp_path}/f1,step:5:{tmp_path}/f2")
    cfg = small_config(str(tmp_path), "faulty", train=train)
    state = grpo_pipeline.with_options(retries=0)(cfg, return_state=True)
    assert state.is_completed() and all(os.path.exists(tmp_path / f) for f in ("f1", "f2"))
    run = RunRoot(str(tmp_path / "faulty"))
    assert digest(run.url) == digest(straight)
    assert task_runs(state)["train-epoch-0"] == 2 and task_runs(state)["train-epoch-1"] == 2
    assert rollout_processes(run.url) == []
    with get_client(sync_client=True) as client:
        started = lambda ls: sum("the rollout runs in a process" in x.message for x in ls) >= 4  # 2 epochs, 2 tries
        logs = wait_logs(client, state.state_details.flow_run_id, started)
    text = "\n".join(x.message for x in logs)
    assert "the rollout runs in a process of its own (pid" in text
    assert "the rollout process (pid" in text and "was killed by SIGKILL" in text  # the failed attempt's reason
    assert "rollout v0 (staleness 0)" in text and "rollout v1 (staleness 1)" in text
    tables = artifacts("rollout-faulty-epoch-1")
    row = json.loads(tables[-1].data)[0]
    assert (row["layout"], row["max_staleness"], row["staleness_max"], row["last_version"]) == ("split", 1, 1.0, 4)


@pytest.mark.slow  # compiles the tiny run's programs for v5e:2x2 three ways (~1-2 min on 2 cores)
def test_grpo_check_target_estimates_the_split_step(tmp_path):
    """`grpo check --target v5e:2x2 --json` with the split layout: the learner's programs compiled
    for 2 chips, the rollout's for the other 2, and the asynchronous step (the slower side) beside
    the synchronous ones (the split's sum, and every chip's), each from the compiler's figures."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, GRPO_AOT_CACHE_DIR=str(tmp_path / "aot"), PREFECT_HOME=str(tmp_path / "pf"), PYTHONPATH=root)
    cmd = [sys.executable, "-m", "flows.cli", "check", "--target", "v5e:2x2", "--json"]
    for s in (f"storage.root={tmp_path / 'runs'}", "eval.batch_size=8", "train.rollout.layout=split"):
        cmd += ["--set", s]
    cmd += ["--set", "train.max_staleness=1"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    est = json.loads(proc.stdout)["estimate"]
    split = est["split"]
    assert (split["learner_chips"], split["rollout_chips"], split["max_staleness"]) == (2, 2, 1)
    assert split["fits"] and not split["missing"] and split["learner_s"] > 0 and split["rollout_s"] > 0
    assert split["sync_step_s"] == pytest.approx(split["learner_s"] + split["rollout_s"])
    assert split["async_step_s"] == max(split["learner_s"], split["rollout_s"]) == split["step_s"]
    assert split["slower_side"] in ("learner", "rollout") and split["colocated_step_s"] == est["step_s"]
    assert {r["program"] for r in split["programs"]["learner"]} == {"update"}  # beta 0: no reference
    assert {r["program"] for r in split["programs"]["rollout"]} == {"prefill", "decode"}
    # the rollout on 2 chips reads its weights split 2 ways, not 4: more bytes a chip than on all 4
    on4 = {r["program"]: r for r in est["programs"]}
    on2 = {r["program"]: r for r in split["programs"]["rollout"]}
    assert on2["decode"]["bytes"] > on4["decode"]["bytes"]
    text = subprocess.run(
        [c for c in cmd if c != "--json"], cwd=root, env=env, capture_output=True, text=True, timeout=600
    ).stdout
    assert "split   learner 2 chips >= " in text and "asynchronous (max_staleness >= 1, the " in text


@pytest.mark.slow  # four short runs of the worker (~1 min)
def test_the_benchmark_writes_its_table_and_json(tmp_path):
    """bench.async_rollout as its docs run it, cut to a few steps: the four runs of a workload, each
    with its rate, both sides' busy fractions, its accuracy and the load it ran under."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "async.json"
    cmd = [sys.executable, "-m", "bench.async_rollout", "--workload", "demo", "--steps", "8", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    from bench.async_rollout import CONFIGS

    assert CONFIGS == [("colocated", 0), ("split", 0), ("split", 1), ("split", 2)]
    assert [(r["layout"], r["max_staleness"]) for r in runs] == CONFIGS
    for r in runs:  # timings are this machine's: their relations are checked, not their values
        assert r["steps_per_s"] > 0 and 0 <= r["accuracy"] <= 1 and r["load_before"] >= 0
        assert r["slow_side_busy"] == r[f"{r['slow_side']}_busy"] == max(r["learner_busy"], r["rollout_busy"]) > 0
    assert [r["staleness_mean"] for r in runs] == [0.0, 0.0, 1.0, 2.0]  # steps 5..7: past the first k
    assert "split k=1" in proc.stdout and "steps/s" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["split", "colocated"])
def test_bf16_and_lora_runs_draw_ahead_with_their_corrections(tmp_path, layout):
    """bfloat16 (the learner rescores the sampler's numbers) with LoRA, k = 1: the side that holds
    the drawing version scores the batch in the learner's numerics (the split process merges the
    adapters it is sent), the mismatch correction weighs it as in a synchronous run, and the run
    trains; steps 0 and 1, both drawn by version 0, are the same batches in both layouts."""
    model = {"dtype": "bfloat16", "lora": {"rank": 4, "alpha": 8}}
    root = make_run(str(tmp_path), layout, model=model, train={**train_section(1, layout), "num_steps": 4})
    ev, _ = run_events(worker(root, 4))
    steps = [e for e in ev if e["event"] == "step"]
    assert [e["async/staleness"] for e in steps] == [0, 1, 1, 1]
    rows = sorted(RunRoot(root).read_metrics(), key=lambda r: r["step"])
    assert all(np.isfinite(r["rollout_is/mismatch_kl"]) and 0 < r["rollout_is/weight_mean"] <= 2 for r in rows)
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
    _FIRST_TWO[layout] = [(r["reward"], r["completions/mean_length"]) for r in rows[:2]]
    if len(_FIRST_TWO) == 2:  # the second layout's run (both in this session): the same first batches
        assert _FIRST_TWO["split"] == _FIRST_TWO["colocated"]


_FIRST_TWO: dict[str, list] = {}
