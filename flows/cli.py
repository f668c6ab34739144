"""The `grpo` command line.

    grpo demo [--task T]           the pipeline on the embedded default (or a demo task over it: tools),
                                   then where everything is
    grpo run   [--config F] [--set k=v ...]   the pipeline, locally, with live progress
    grpo check [--config F] [--set k=v ...] [--json] [--target v5e:2x2]
                                   the readiness report (--target: XLA's figures for a TPU slice)
    grpo eval  RUN --step N [--step M ...]   evaluate checkpoints of a run
    grpo export RUN [--step N]     a checkpoint as a Hugging Face folder, RUN/export/{step}/
    grpo status RUN [--json]       where a run stands, from its run root
    grpo serve [--cron C | --interval S] [--config F] [--set k=v ...]   serve the deployments
    grpo tiny-model DIR            a small random Qwen3 model + tokenizer to try model.path offline
                                   (--reward-model: a reward model, to try rewards[].model)

RUN is a run's URL (a folder or gs://bucket/prefix/name) or a run name under storage.root.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import time

# Everything else is imported inside the command that needs it, marked `# CLI start`: `grpo --help`
# loads the standard library alone, and `grpo check` no Prefect (tests/test_boundaries.py).


def _prefect_defaults() -> None:
    """Local runs start Prefect's embedded server: no telemetry, and enough time to start on a
    small machine (it takes 10-35 s on 2 cores). Settings the user made win."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


_SIGNALS: list[int] = []  # what stopped the command: it exits with 128 + the first
_API_GONE = [False]  # whether this command's run lost its Prefect API: nothing more can be sent to it


def _exit_abandoning_prefect(code: int) -> None:
    """End the program now, without the wait Prefect's event and log services spend at exit on what
    they still hold for an API that is gone: they try each item for seconds, one after another (6
    events and the last log lines kept a failed run's CLI 43 s past its message, printing a warning
    and an error for each). The run's own clean-up is done by now (the flow stopped its workers,
    released its lease, dropped the worker started ahead: drop_ahead again costs nothing)."""
    try:
        from grpo_core.launch.launchers import drop_all_ahead  # CLI start: loaded with the pipeline

        drop_all_ahead()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
    finally:
        os._exit(code)


def _say(text: str) -> None:
    """A line on stderr that cannot fail: with the terminal or the pipe gone (the parent that read
    our output died), a signal handler must still do its job."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


@contextlib.contextmanager
def _interruptible():
    """Ctrl-C (SIGINT) and SIGTERM, what a user and a scheduler send. The first stops the running
    stage's workers at their next step boundary, where they save a checkpoint (within about 10 s),
    and ends the command with RunInterrupted (a KeyboardInterrupt); a second exits at once, its
    workers killed. Without this, SIGINT raised KeyboardInterrupt somewhere inside Prefect while
    the workers, in process groups of their own, trained on."""
    from grpo_core.errors import RunInterrupted  # CLI start
    from tasks.process import STOP_REPORT_ENV, kill_live_workers, request_interrupt, watch_the_stop  # CLI start

    count, ended = 0, None

    def exit_now(signum: int, message: str) -> None:
        """Kill the workers, say why, exit: whatever happens on the way (a closed terminal)."""
        try:
            kill_live_workers()
            _say(message)
        finally:
            os._exit(128 + signum)

    def stuck(signum: int, name: str, seconds: float) -> None:
        exit_now(
            signum,
            f"\n{name}: the run has not ended {seconds:g} s after its workers stopped (is the Prefect API "
            "reachable? its client retries each call for about a minute): exiting now, without the run's "
            f"summary; its newest checkpoint is kept and the same command resumes from it "
            f"({STOP_REPORT_ENV} sets the wait)",
        )

    def handler(signum, _frame):
        nonlocal count, ended
        count += 1
        _SIGNALS.append(signum)
        name = signal.Signals(signum).name
        if count > 1:
            exit_now(signum, f"\n{name} again: exiting now")
        live = request_interrupt()
        ended = watch_the_stop(lambda seconds: stuck(signum, name, seconds))
        _say(
            f"\n{name}: stopping the run"
            + (" (its workers save a checkpoint at the next step boundary, within ~10 s)" if live else "")
            + "; press Ctrl-C again to exit at once"
        )
        if not live:  # no worker to wait for: stop the in-process stage where it is
            raise RunInterrupted(f"interrupted by {name}")

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        if ended is not None:  # the stopped run ended: its watch is over
            ended.set()
        for sig, h in old.items():
            signal.signal(sig, h)


# `grpo demo --task NAME`: what each demo task is (the names and configs: grpo_core.config.run.DEMO_TASKS)
_DEMO_ABOUT = {
    "reverse": "the embedded default, reverse a word",
    "tools": "the synthetic tool task: the answer is a code only the codebook environment's tool code() tells; "
    "the model learns to call it and answer with what it returned (train.agent)",
}


class _DemoHelp(argparse.HelpFormatter):
    """`grpo demo --help`: the demo tasks, read from the config only when the help is printed (the
    parser is built for every command, and `grpo --help` loads the standard library alone)."""

    def _get_help_string(self, action):
        text = super()._get_help_string(action) or ""
        if action.dest != "task":
            return text
        from grpo_core.config.run import DEMO_TASKS  # CLI start: the config, for this help only

        tasks = "; ".join(f"{name} ({_DEMO_ABOUT.get(name, 'a config over the default')})" for name in DEMO_TASKS)
        return f"{text}: {tasks}".replace("%", "%%")


def demo_config(task: str, path: str | None = None, overrides: list[str] | None = None):
    """The config `grpo demo --task TASK --config PATH --set ...` runs: the default, then the task's
    config (DEMO_TASKS, as a --config file would be), then the YAML file, then the overrides."""
    from grpo_core.config.fields import apply_overrides  # CLI start: the config
    from grpo_core.config.run import DEMO_TASKS, RunConfig, _merge, absolute_paths, read_config  # CLI start
    from grpo_core.errors import ConfigError  # CLI start

    if task not in DEMO_TASKS:
        raise ConfigError(f"--task {task!r} is not a demo task ({', '.join(DEMO_TASKS)})")
    given = _merge(DEMO_TASKS[task], read_config(path))
    return RunConfig.from_dict(absolute_paths(apply_overrides(given, overrides or [])))


def _config(args):
    """The run config from --config and --set (and grpo demo's --task), or None after printing the
    error (exit 2)."""
    from grpo_core.config.run import load_config  # CLI start
    from grpo_core.errors import ConfigError, StorageError  # CLI start
    from grpo_core.resolve import resolve_run  # CLI start

    try:
        task = getattr(args, "task", None)
        cfg = demo_config(task, args.config, args.set) if task else load_config(args.config, args.set)
        # with the versions of the sources it names: the run's name depends on them (run_name: null)
        # a run_name template ({date}, ...) filled in now: the command prints the folder it names
        cfg = cfg.with_run_name(datetime.datetime.now(datetime.timezone.utc))
        return resolve_run(cfg, warn=lambda w: print(f"warning: {w}", file=sys.stderr))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return None
    except StorageError as exc:  # a gs:// source out of reach: its message names the field, no traceback
        print(f"storage error: {exc}", file=sys.stderr)
        return None


def _run_url(run: str, args) -> str:
    if "://" in run or os.sep in run or run.startswith("."):
        return run if "://" in run else os.path.abspath(run)
    from grpo_core.config.run import load_config  # CLI start

    cfg = load_config(getattr(args, "config", None), getattr(args, "set", []) + [f"run_name={run}"])
    return cfg.run_url


def _run_of(args) -> str | None:
    """The URL of RUN (a folder, a URL or a run name under storage.root), or None after saying why
    it is not a run (exit 2): a name that is not one folder, a folder with no config.json (`..`
    or `../../etc` names no run, so nothing reads or writes there)."""
    from grpo_core.errors import ConfigError, StorageError  # CLI start
    from grpo_core.store.root import RunRoot  # CLI start

    try:
        url = _run_url(args.run, args)
        if RunRoot(url).exists("config.json"):
            return url
        print(
            f"error: {url} is not a run: it has no config.json (RUN {args.run!r}: give a run's folder or URL, "
            "or a run name under storage.root)",
            file=sys.stderr,
        )
    except (ConfigError, StorageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
    return None


def _times(s: dict, wall: float) -> str:
    """The flow's wall time as summary.json records it, and the command's, each saying what it
    measures: "354 s" printed beside summary.json's 340.35 read as two figures for one thing."""
    flow, run = (s.get("last_invocation") or {}).get("wall_s"), (s.get("timing") or {}).get("wall_s")
    if flow is None:
        return f"the command {wall:.2f} s"
    out = f"the flow {flow:.2f} s (summary.json last_invocation.wall_s"
    if run is not None and round(run, 2) != round(flow, 2):  # a resumed run: earlier invocations count there
        out += f"; the run's invocations together {run:.2f} s, timing.wall_s"
    return out + f"), the command {wall:.2f} s (with the local Prefect server's start and stop)"


def _print_summary(s: dict, wall: float) -> None:
    print(f"\nrun {s['status']}: {s['run_uri']}  ({s['steps']} steps)")
    print(f"time: {_times(s, wall)}")
    if s.get("started_from"):
        print(
            f"started from {s['started_from']['uri']} (step {s['started_from']['step']} of {s['started_from']['run']})"
        )
    if s.get("reward_mean_first") is not None:
        print(
            f"training reward (mean of the first / last tenth of steps): "
            f"{s['reward_mean_first']:.3f} -> {s['reward_mean_last']:.3f}"
        )
    before, after = s.get("eval_before") or {}, s.get("eval_after") or {}
    names = sorted(k for k in after if k != "step")
    width = max([12, *map(len, names)])  # an agentic run's tool_calls_per_episode, ... in one column too
    for k in names:
        print(f"eval {k:<{width}} {before.get(k, float('nan')):.3f} (step 0) -> {after[k]:.3f} (step {after['step']})")
    print("\nin the run root:")
    for what, rel in (
        ("config", "config.json"),
        ("summary", "summary.json"),
        ("curve", "curve.png"),
        ("metrics", "metrics/"),
        ("evaluations", "eval/"),
        ("readiness", "readiness.json"),
    ):
        print(f"  {what:<12} {s['run_uri']}/{rel}")
    print(f"  {'checkpoint':<12} {s['checkpoint_uri']}")
    if s.get("export_uri"):
        # a loader that runs where the run ran (`make demo` installs no PyTorch), and the one users know
        print(f"  {'HF export':<12} {s['export_uri']}")
        print(f"  {'':<12} try it: grpo generate {s['export_uri']} PROMPT  (transformers loads it too, with PyTorch)")


def _print_examples(run_url: str) -> None:
    from grpo_core.store.report import eval_results  # CLI start
    from grpo_core.store.root import RunRoot  # CLI start

    evals = eval_results(RunRoot(run_url))
    if len(evals) < 2 or not evals[0].get("examples"):
        return
    first, last = evals[0], evals[-1]
    if any("episode" in e for e in first["examples"]):
        _print_episodes(first, last)
        return
    print(f"\nheld-out prompts, greedy: prompt -> step {first['step']} | step {last['step']} | expected")
    for a, b in zip(first["examples"], last["examples"]):
        print(f"  {a['prompt']!r:>10} -> {a['completion']!r:>10} | {b['completion']!r:>8} | {a.get('answer', '')!r}")


def _print_episodes(first: dict, last: dict) -> None:
    """An agentic run's examples (train.agent): each prompt's greedy episode at the first and the last
    evaluated step, its turns, calls and tool results on one line each."""
    print(f"\nheld-out prompts, greedy episodes at step {first['step']} and step {last['step']}:")
    width = len(str(last["step"]))
    for a, b in zip(first["examples"], last["examples"]):
        print(f"  {a['prompt']!r}" + (f"  (expected {a['answer']!r})" if "answer" in a else ""))
        for example, result in ((a, first), (b, last)):
            print(f"    step {result['step']:>{width}}: {episode_text(example.get('episode') or [])}")


def episode_text(messages: list[dict]) -> str:
    """An episode (its assistant and tool messages after the prompt) on one line:
    `call code() -> 006 -> answer 006`."""
    parts = []
    for m in messages:
        if m.get("role") == "tool":
            parts.append(_short(str(m.get("content", ""))))
            continue
        calls = m.get("tool_calls") or []
        content = str(m.get("content") or "")
        if content and calls:
            parts.append(f"says {_short(content)}")
        for c in calls:
            fn = c.get("function", c)
            parts.append(f"call {fn.get('name', '?')}({_arguments(fn.get('arguments'))})")
        if not calls:
            parts.append(f"answer {_short(content)}")
    return " -> ".join(parts) or "(nothing)"


def _arguments(args) -> str:
    """A call's arguments as written: positional words (the plain format's `_0`, `_1`) as they are,
    keywords as k=v."""
    if not isinstance(args, dict):
        return _short(str(args))
    if all(k.startswith("_") and k[1:].isdigit() for k in args):
        return ", ".join(_short(str(args[k])) for k in sorted(args, key=lambda k: int(k[1:])))
    return ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in args.items())


def _short(text: str, most: int = 40) -> str:
    """A turn's or a result's text: as it is when it reads as one word, else quoted; cut at `most`."""
    cut = text if len(text) <= most else text[:most] + "..."
    return cut if cut and cut.strip() == cut and not any(c in cut for c in " \n\t'\"") else repr(cut)


def _bars() -> dict[str, bool]:
    """Progress bars (tasks.progress) only where a person watches: stderr a terminal, not a pipe or CI."""
    tty = sys.stderr.isatty() and os.environ.get("TERM") != "dumb"
    return {"enabled": tty, "redirect_stdout": tty and sys.stdout.isatty()}


def run_command(args) -> int:
    cfg = _config(args)
    if cfg is None:
        return 2
    _prefect_defaults()
    from grpo_core.launch.processes import imports_without_gc  # CLI start: standard library

    with imports_without_gc():  # Prefect's imports: 1.84 -> 1.58 CPU-s
        from flows.local_server import embedded_server  # CLI start: Prefect, after _prefect_defaults
        from flows.pipeline import grpo_pipeline  # CLI start: Prefect, after _prefect_defaults
        from tasks.progress import terminal_bars  # CLI start: rich, which Prefect loads

    t = time.perf_counter()
    print(f"run {cfg.name}: {cfg.run_url}", flush=True)
    if cfg.rewards_default is not None:  # rewards the config did not name: which, and why (as grpo check says)
        chosen = cfg.rewards_default
        print(f"rewards {', '.join(chosen.describe())}: {chosen.why} (set rewards to choose others)", flush=True)
    try:
        with _interruptible(), embedded_server(), terminal_bars(num_steps=cfg.train.num_steps, **_bars()):
            # the flow takes the config's fields and finds the sources' versions itself
            params = {k: v for k, v in cfg.to_dict().items() if k != "versions"}
            summary = grpo_pipeline.with_options(retries=cfg.pipeline.flow_retries)(params)
    except KeyboardInterrupt as exc:
        print(
            f"\nrun interrupted: {exc or 'KeyboardInterrupt'}\n"
            f"the same command resumes it; see {cfg.run_url}/summary.json",
            file=sys.stderr,
        )
        return 128 + (_SIGNALS[0] if _SIGNALS else signal.SIGINT)
    except Exception as exc:  # noqa: BLE001 - the flow logged it; say where the evidence is
        import httpx  # CLI start: Prefect's HTTP client, loaded with it

        from grpo_core.errors import StorageError  # CLI start
        from grpo_core.store.lease import LeaseHeld, RunRootInUse  # CLI start

        if isinstance(exc, RunRootInUse):  # another run owns the run root: its summary.json is not ours
            print(f"\nrun {'refused' if isinstance(exc, LeaseHeld) else 'stopped'}: {exc}", file=sys.stderr)
            return 1
        # a storage error may mean summary.json could not be written either: then point at the log only
        where = "" if isinstance(exc, StorageError) else f"\nsee {cfg.run_url}/summary.json"
        if isinstance(exc, httpx.TransportError):  # Prefect's client gave up on its API, after its retries
            from prefect.settings import PREFECT_API_URL  # CLI start: Prefect, loaded by now

            _API_GONE[0] = True
            print(
                f"\nrun failed: the Prefect API at {PREFECT_API_URL.value()} did not answer ({type(exc).__name__}: "
                f"{exc}); what the workers saved is kept, and the same command resumes from the newest checkpoint "
                f"once the API answers{where}",
                file=sys.stderr,
            )
            return 1
        print(f"\nrun failed: {type(exc).__name__}: {exc}{where}", file=sys.stderr)
        return exit_code(exc)
    _print_summary(summary, time.perf_counter() - t)
    if args.command == "demo":
        _print_examples(cfg.run_url)
    return 0


def exit_code(exc: BaseException) -> int:
    """What `grpo run` exits with for a run that failed: the failing stage's code (a worker's, or
    the readiness check's 4), or the code grpo_core.errors' table gives the exception (a config
    error in the flow: 2); 1 for anything else (docs/concepts.md lists them)."""
    from grpo_core.errors import classify  # CLI start

    code = getattr(exc, "code", None)
    if isinstance(code, int) and code > 0:
        return int(code)
    known = classify(exc)
    return int(known.code) if known is not None else 1


def check_command(args) -> int:
    if args.target:  # the same as --set pipeline.readiness.target=...
        args.set = [*args.set, f"pipeline.readiness.target={args.target}"]
        args.set += [f"pipeline.readiness.num_slices={args.num_slices}"] if args.num_slices else []
    cfg = _config(args)
    if cfg is None:
        return 2
    from grpo_core.errors import ExitCode  # CLI start
    from tasks.readiness import readiness_report  # CLI start

    # the data too: prompts its tokenizer cannot encode, before any run; a reward model's scores against transformers'
    report = readiness_report(cfg, data=True, parity=True)
    report["recipe"] = _recipe(args, cfg)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(
            f"{'ready' if report['ready'] else 'NOT READY'}: {report.get('backend')} "
            f"{report.get('device_kind')} x {report.get('device_count')}, {report.get('process_count')} process(es)"
        )
        recipe = report["recipe"]
        print(f"defaults: the {recipe['recipe']!r} recipe ({recipe['why']}) filled the fields not set:")
        for name, d in recipe["filled"].items():
            print(f"  {name:<34} {d['value']!r:<12} {d['source']}")
        for c in report["checks"]:
            print(f"  {'ok ' if c['ok'] else 'FAIL'} {c['name']:<18} {c['detail']}")
            if not c["ok"] and c.get("fix"):
                print(f"       fix: {c['fix']}")
        if report.get("target", {}).get("programs"):
            _print_programs(report["target"])
        if report.get("estimate"):
            _print_estimate(report["estimate"])
    return 0 if report["ready"] else ExitCode.NOT_READY


def _print_programs(aot: dict) -> None:
    """XLA's figures per program and chip (grpo_core.rl.aot), one line each: memory in GiB, and a
    call's GFLOP and bound in ms with its loops counted (the estimate's; decode's full length)."""
    gib = lambda n: "-" if n is None else f"{n / 2**30:.2f}"
    t = aot["target"]
    timed = {r["program"]: r for r in (aot.get("estimate") or {}).get("programs", [])}
    print(f"\nper chip on {t['topology']} ({t['device_kind']}, HBM {gib(t['hbm_bytes'])} GiB), GiB:")
    print(
        f"  {'program':<13} {'args':>6} {'out':>6} {'temp':>6} {'XLA peak':>8} {'+resident':>9} {'peak':>6}  "
        f"{'GFLOP':>9} {'bound ms':>9} {'':<7} {'compile s':>9}"
    )
    for p in aot["programs"]:
        r = timed.get(p["program"])
        speed = f"{r['flops'] / 1e9:>9.1f} {r['s'] * 1e3:>9.2f} {r['bound']:<7}" if r else f"{'-':>9} {'-':>9} {'':<7}"
        print(
            f"  {p['program']:<13} {gib(p.get('argument_bytes')):>6} {gib(p.get('output_bytes')):>6} "
            f"{gib(p.get('temp_bytes')):>6} {gib(p.get('xla_peak_bytes')):>8} {gib(p['resident_bytes']):>9} "
            f"{gib(p.get('peak_bytes')):>6}{'' if p['fits'] else ' !'} {speed} "
            + (f"{'cached':>9}" if p.get("cached") else f"{p['compile_s']:>9.1f}")
        )


def _print_estimate(e: dict) -> None:
    """The roofline bound of a step and of the run (grpo_core.config.roofline), in a few lines."""
    pk = e["peaks"]
    print(
        f"\nspeed, a roofline bound (a lower bound on time: max(FLOPs / {pk['bf16_flops_per_s'] / 1e12:g} TFLOP/s, "
        f"bytes / {pk['hbm_bytes_per_s'] / 1e9:g} GB/s) per program and chip; {pk['generation']}'s published peaks):"
    )
    if e["step_s"] is None:
        print(f"  no step bound: {', '.join(e['missing'])} not compiled")
        return
    split = e["split_s"]
    parts = [f"{k} {_duration(split[k])}" for k in ("rollout", "reference", "old_logprobs") if k in split]
    parts.append(f"update {e['updates_per_step']} x {_duration(split['update'] / e['updates_per_step'])}")
    print(f"  step    >= {_duration(e['step_s'])} = {' + '.join(parts)}")
    print(
        f"  rollout >= {_duration(e['rollout_tokens'] / e['rollout_tokens_per_s'])} for {e['rollout_tokens']} tokens: "
        f"<= {e['rollout_tokens_per_s']:,.0f} tokens/s (every completion full length)"
    )
    if e.get("run_s") is not None:
        ev = e["eval"]
        evals = (
            " (evaluation not counted)"
            if ev["s"] is None
            else f" + {e['evaluations']} evaluations x {_duration(ev['s'])}"
        )
        print(f"  run     >= {_duration(e['run_s'])} = {e['num_steps']} steps x {_duration(e['step_s'])}{evals}")
    print(f"  ignores: {'; '.join(e['ignores'])}")
    split = e.get("split")
    if split is not None and split["async_step_s"] is not None:  # train.rollout.layout=split
        print(
            f"  split   learner {split['learner_chips']} chips >= {_duration(split['learner_s'])}, rollout "
            f"{split['rollout_chips']} chips >= {_duration(split['rollout_s'])}: synchronous step >= "
            f"{_duration(split['sync_step_s'])}, asynchronous (max_staleness >= 1, the {split['slower_side']}) >= "
            f"{_duration(split['async_step_s'])}; every chip synchronous >= {_duration(split['colocated_step_s'])}"
            + ("" if split["fits"] else " (a side does not fit its chips)")
        )
    for line in e.get("advice") or []:
        print(f"  advice:  {line}")


def _duration(s: float) -> str:
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    return f"{s:.3g} s" if s < 120 else f"{s / 60:.3g} min" if s < 7200 else f"{s / 3600:.3g} h"


def _recipe(args, cfg) -> dict:
    """Which recipe filled which fields of this config and why (grpo_core.config.recipes), with
    train.num_steps: auto as the number the data made it."""
    from grpo_core.config.recipes import explain  # CLI start
    from grpo_core.config.run import DEFAULT, read_config  # CLI start

    out = explain(read_config(args.config, args.set), DEFAULT)
    steps = out["filled"].get("train.num_steps")
    if steps is not None and steps["value"] == "auto" and cfg.train.num_steps != "auto":
        steps.update(value=cfg.train.num_steps, source=f"auto: {steps['source']}")
    chosen = cfg.rewards_default  # the default rewards as the data's first row decided them
    if chosen is not None and "rewards" in out["filled"]:
        out["filled"]["rewards"] = {"value": chosen.describe(), "source": chosen.why}
    return out


def _unchanged_by_set(url: str, args) -> bool:
    """Whether --set leaves the run's config as it is (grpo_core.store.runs.check_overrides); else
    False after saying what it would change (exit 2): this command would not apply it."""
    from grpo_core.errors import ConfigError, StorageError  # CLI start
    from grpo_core.store.root import RunRoot  # CLI start
    from grpo_core.store.runs import check_overrides  # CLI start

    try:
        check_overrides(RunRoot(url), args.set, f"grpo {args.command}")
        return True
    except (ConfigError, StorageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return False


def eval_command(args) -> int:
    from tasks.process import StageError, run_worker  # CLI start
    from tasks.progress import terminal_bars  # CLI start: rich

    url = _run_of(args)
    if url is None or not _unchanged_by_set(url, args):
        return 2

    def show(e):
        if e["event"] == "eval":
            extra = "  ".join(f"{k} {v:.3f}" for k, v in e.items() if k.startswith("pass@"))
            print(
                f"step {e['step']:>6}: accuracy {e['accuracy']:.3f}  {extra}  {e['uri']}"
                f"{'  (already evaluated)' if e['cached'] else ''}",
                flush=True,
            )

    try:
        with _interruptible(), terminal_bars(**_bars()):
            run_worker(
                ["grpo_core.stages.worker", "eval", "--root", url, "--steps", ",".join(map(str, args.step))],
                timeout_s=args.timeout,
                on_event=show,
                what="evaluation",
            )
    except KeyboardInterrupt as exc:
        print(f"interrupted: {exc}", file=sys.stderr)
        return 128 + (_SIGNALS[0] if _SIGNALS else signal.SIGINT)
    except StageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if not exc.retryable else 1
    return 0


def export_command(args) -> int:
    from tasks.process import StageError, run_worker  # CLI start

    url = _run_of(args)
    if url is None or not _unchanged_by_set(url, args):
        return 2
    cmd = ["grpo_core.stages.worker", "export", "--root", url] + (
        ["--step", str(args.step)] if args.step is not None else []
    )

    def show(e):
        if e["event"] == "export":
            print(f"step {e['step']}: {e['uri']}{'  (already exported)' if e['cached'] else ''}", flush=True)

    try:
        with _interruptible():
            run_worker(cmd, timeout_s=args.timeout, on_event=show, what="export")
    except KeyboardInterrupt as exc:
        print(f"interrupted: {exc}", file=sys.stderr)
        return 128 + (_SIGNALS[0] if _SIGNALS else signal.SIGINT)
    except StageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if not exc.retryable else 1
    return 0


def status_command(args) -> int:
    from grpo_core.store.report import status  # CLI start
    from grpo_core.store.root import RunRoot  # CLI start

    url = _run_of(args)
    if url is None:
        return 2
    import logging  # CLI start

    from grpo_core.errors import ConfigError, ExitCode, StorageError  # CLI start

    # a damaged metrics line is left out with a warning naming the file: said here, not as a traceback
    damaged = logging.StreamHandler(sys.stderr)
    damaged.setFormatter(logging.Formatter("warning: %(message)s"))
    store_log = logging.getLogger("grpo_core.store")
    store_log.addHandler(damaged)
    try:
        st = status(RunRoot(url))
    except (FileNotFoundError, ConfigError) as exc:  # a damaged file (DamagedFile) names itself
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except StorageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.STORAGE
    except (KeyError, TypeError, ValueError) as exc:  # a config.json of another shape: no traceback either
        print(f"error: {url}/config.json is not a run's config as this version writes it ({exc!r})", file=sys.stderr)
        return 2
    finally:
        store_log.removeHandler(damaged)
    if args.json:
        print(json.dumps(st, indent=1))
        return 0
    summary = st["summary"] or {}
    print(f"run {st['run_uri']}: {summary.get('status', 'in progress or stopped')}")
    if summary.get("error") and summary.get("status") != "completed":
        print(f"  why: {summary['error']}")
    print(
        f"  steps {st['steps_done']}/{st['num_steps']}, latest checkpoint {st['latest_checkpoint']}, "
        f"Hugging Face export {st['export_uri'] or 'none'}"
    )
    print(f"  stages done: {', '.join(st['stages_done']) or 'none'}; readiness: {st['readiness']}")
    if st["last_metrics"]:  # its step counted as steps_done counts it (grpo_core.store.report.status)
        print("  last step: " + "  ".join(f"{k} {v:.4g}" for k, v in st["last_metrics"].items()))
    for e in st["eval"]:
        print("  eval " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in e.items()))
    if st["metrics_missing"]:  # a wiped bucket, a shard lost: the curve and the means leave these steps out
        print(f"  metrics missing for steps {', '.join(st['metrics_missing'])} (the checkpoints hold those steps)")
    return 0


def serve_command(args) -> int:
    if not os.environ.get("PREFECT_API_URL"):
        print(
            "grpo serve needs a Prefect server: start one with `prefect server start` (it listens on "
            "127.0.0.1:4200) and export PREFECT_API_URL=http://127.0.0.1:4200/api",
            file=sys.stderr,
        )
        return 2
    params = None
    if args.config or args.set:
        cfg = _config(args)
        if cfg is None:
            return 2
        from flows.params import RunParams  # CLI start: pydantic
        from grpo_core.config.run import read_config  # CLI start

        # What the user gave, not the resolved config: a form field left as the deployment shows
        # it then means the default for the config the run starts with. A key given as null
        # where null means "the default" is left out (the form's schema has no null there).
        params = RunParams.model_validate(read_config(args.config, args.set)).model_dump(exclude_unset=True)
    from grpo_core.launch.processes import imports_without_gc  # CLI start: standard library

    with imports_without_gc():
        from flows.serve import allow_code  # CLI start: Prefect

    try:  # what the deployments' runs may name besides the built-ins (grpo_core.rewards.trust)
        allow_code(
            args.allow_reward_path,
            args.allow_reward_module,
            args.allow_field,
            params,
            args.allow_root,
            args.allow_host,
            args.raise_limit,
        )
    except ValueError as exc:
        print(f"grpo serve: {exc}", file=sys.stderr)
        return 2
    from flows.serve import serve  # CLI start: Prefect

    serve(params, cron=args.cron, interval=args.interval, limit=args.limit)
    return 0


def generate_command(args) -> int:
    """`grpo generate`: in a process of its own (this one never loads JAX), grpo_core.stages.generate."""
    cmd = [sys.executable, "-m", "grpo_core.stages.generate", args.folder, "--max-new-tokens", str(args.max_new_tokens)]
    return subprocess.run([*cmd, *(["--chat"] if args.chat else []), *args.prompts]).returncode


def tiny_model_command(args) -> int:
    from grpo_core.nn.tiny_hf import write_tiny_model  # CLI start (numpy, safetensors, tokenizers: no JAX)

    folder = write_tiny_model(args.dir, arch=args.arch, seed=args.seed, reward_model=args.reward_model)
    if args.reward_model:
        print(
            f"wrote a tiny random {args.arch} reward model (a one-label sequence classifier) and its tokenizer to "
            f"{folder}: --set 'rewards=[{{model: {args.dir}}}]'"
        )
        return 0
    print(f"wrote a tiny random {args.arch} model and its tokenizer to {folder}: --set model.path={args.dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpo", description="GRPO post-training in JAX, run as a Prefect pipeline")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p):
        p.add_argument("--config", help="YAML file over the default config")
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override, e.g. --set train.grpo.beta=0.04 (repeatable)",
        )
        return p

    p = with_config(sub.add_parser("demo", help="the pipeline on the embedded default", formatter_class=_DemoHelp))
    p.add_argument("--task", default="reverse", help="the demo task (default: reverse), a config over the default")
    p.set_defaults(func=run_command)
    with_config(sub.add_parser("run", help="run the pipeline locally")).set_defaults(func=run_command)
    p = with_config(sub.add_parser("check", help="print the readiness report"))
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.add_argument(
        "--target",
        metavar="TOPOLOGY",
        help="also compile every program for this TPU topology (v5e:2x2, v4:2x2x1, v6e:4x4) and check XLA's "
        "memory figures against its HBM, from any host (pipeline.readiness.target; needs '.[tpu-aot]')",
    )
    p.add_argument("--num-slices", type=int, help="slices of the --target (pipeline.readiness.num_slices)")
    p.set_defaults(func=check_command)
    p = with_config(sub.add_parser("eval", help="evaluate checkpoints of a run"))
    p.add_argument("run", help="run URL or name under storage.root")
    p.add_argument("--step", type=int, action="append", required=True, help="checkpoint step (0: starting policy)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the evaluation is stopped")
    p.set_defaults(func=eval_command)
    p = with_config(sub.add_parser("export", help="write a checkpoint as a Hugging Face model folder"))
    p.add_argument("run", help="run URL or name under storage.root")
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest; 0: the starting policy)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the export is stopped")
    p.set_defaults(func=export_command)
    p = with_config(sub.add_parser("status", help="where a run stands"))
    p.add_argument("run", help="run URL or name under storage.root")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=status_command)
    p = with_config(sub.add_parser("serve", help="serve the deployments against PREFECT_API_URL"))
    p.add_argument(
        "--cron", help="schedule the pipeline deployment, e.g. '0 2 * * *' (with --config/--set as its parameters)"
    )
    p.add_argument("--interval", type=float, help="schedule the pipeline deployment every N seconds")
    p.add_argument(
        "--limit", type=int, default=1, help="flow runs at a time in this process (default 1: one accelerator)"
    )
    p.add_argument(
        "--allow-reward-path",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder (or file) of reward functions a run from the API or UI may name (repeatable; "
        "default: ./rewards if it exists)",
    )
    p.add_argument(
        "--allow-reward-module",
        action="append",
        default=[],
        metavar="NAME",
        help="a module (pkg.rewards) or function (pkg.rewards:fn) a run from the API or UI may name (repeatable)",
    )
    p.add_argument(
        "--allow-field",
        action="append",
        default=[],
        metavar="FIELD",
        help="a field naming a program or a remote machine (train.rollout.server_command, pipeline.worker_python, "
        "pipeline.launcher.tpu_name, ...) a run from the API or UI may set (repeatable)",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="HOST[:PORT]",
        help="a host a run from the API or UI may name as an address (train.rollout.url, "
        "pipeline.launcher.address) (repeatable)",
    )
    p.add_argument(
        "--raise-limit",
        action="append",
        default=[],
        metavar="FIELD=N",
        help="the most a run from the API or UI may ask for of FIELD (data.synthetic_rows, train.num_steps, "
        "eval.batch_size, ...: each has a limit that fits one host) (repeatable)",
    )
    p.set_defaults(func=serve_command)
    p.add_argument(
        "--allow-root",
        action="append",
        default=[],
        metavar="ROOT",
        help="a folder or URL prefix (gs://bucket/runs) a run from the API or UI may write (storage.root) or read "
        "(data and model sources) under, besides the places of the served config (repeatable)",
    )
    p = sub.add_parser(
        "tiny-model",
        help="write a small random Hugging Face model (Qwen architecture) and its tokenizer, to try model.path offline",
    )
    p.add_argument("dir", help="the folder to write (config.json, model.safetensors, tokenizer files)")
    p.add_argument("--arch", choices=("qwen3", "qwen2"), default="qwen3", help="the architecture (default qwen3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument(
        "--reward-model",
        action="store_true",
        help="a reward model instead: a one-label *ForSequenceClassification of the same trunk (rewards[].model)",
    )
    p.set_defaults(func=tiny_model_command)
    p = sub.add_parser(
        "generate",
        help="greedy completions from a Hugging Face folder (a run's export) with the project's JAX model: no PyTorch",
    )
    p.add_argument("folder", help="a Hugging Face model folder, e.g. a run's export/STEP/")
    p.add_argument("prompts", nargs="+", help="prompts, each completed greedily")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--chat", action="store_true", help="render each prompt through the tokenizer's chat template")
    p.set_defaults(func=generate_command)
    args = parser.parse_args(argv)
    code = args.func(args)
    if argv is None and _API_GONE[0]:  # the program itself (not a caller's main([...])), its API gone
        _exit_abandoning_prefect(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
