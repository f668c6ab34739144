"""GRPO from a notebook (or any Python program): `train(...)` runs the `grpo_pipeline` flow that
`grpo run` runs, locally, on a config given as Python values, and returns a `Run`
(flows.results). docs: GRPO from a notebook.

    from flows import train
    run = train(data=dataset, rewards=[my_reward], model="Qwen/Qwen3-0.6B", **{"train.num_steps": 50})
    run.metrics; run.plot(); run.load_model()

- The config: a RunConfig, a mapping (the YAML's shape), a YAML file's path or None (the
  defaults), then `overrides` and keyword arguments in the CLI's dotted names
  (`**{"train.num_steps": 4}` is `--set train.num_steps=4`, with Python values).
- The data: a `datasets.Dataset`, a `DatasetDict` (train and, where there is one, test /
  validation), a pandas DataFrame or a list of row dicts, written once as JSONL under
  storage.root (grpo_core.data.in_memory); or a source's name, as data.source takes it.
- The rewards: callables with TRL's signature `(prompts, completions, **columns)`, pickled by value
  for the workers (grpo_core.rewards.by_value), beside built-in names and `file.py:fn` specs;
  `(fn, weight)` or `{"function": fn, "weight": w}` for a weight. A deployment never runs them.
- Agentic runs (train.agent), as TRL's `tools=` and `environment_factory=`: `tools` a list of
  functions (their type hints and docstrings are their schemas), built-in names and `file.py:fn`
  specs; `environment` a class (one instance per episode: reset(**row), its public methods the
  episode's tools, get_reward() a reward) or its spec, `environment_kwargs` what each instance is
  built with. Functions and classes are pickled by value as the rewards are.

The same cell run again (a new kernel too) names the same run, so it resumes or finds it done;
another reward, tool or environment body, or other rows, make a new run. The kernel's first run
starts the embedded Prefect server, which the later ones reuse (flows.local_server.kernel_server);
a kernel interrupt stops the workers at a step boundary, as Ctrl-C does in the terminal
(tasks.process).
"""

from __future__ import annotations

import _thread
import contextlib
import copy
import datetime
import inspect
import logging
import os
import signal
import threading
from typing import Any, Callable, Iterator, Mapping

from flows.cli import _prefect_defaults
from flows.results import Run
from grpo_core.config.run import RunConfig, absolute_paths, read_config
from grpo_core.data.in_memory import is_in_memory, rows_of, split_rows, write_rows
from grpo_core.errors import ConfigError, RunInterrupted
from grpo_core.resolve import resolve_run
from grpo_core.rewards.by_value import reward_name, save_code, save_reward
from grpo_core.rewards.registry import config_rewards
from tasks.process import add_listener, clear_interrupt, kill_live_workers, request_interrupt, watch_the_stop

__all__ = ["Run", "resolve", "train"]

log = logging.getLogger(__name__)


def train(
    config: RunConfig | Mapping[str, Any] | str | os.PathLike | None = None,
    *,
    data: Any = None,
    eval_data: Any = None,
    rewards: list[Any] | None = None,
    eval_rewards: list[Any] | None = None,
    tools: list[Any] | None = None,
    environment: Any = None,
    environment_kwargs: Mapping[str, Any] | None = None,
    model: str | None = None,
    run_name: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    progress: bool = True,
    **settings: Any,
) -> Run:
    """Run the GRPO pipeline (data, readiness, training epochs with their evaluations, export,
    summary) locally, in worker processes, and return the run. See the module's doc for the
    arguments; `progress`: a bar of the training steps (tqdm.auto: a widget in Jupyter).

    Raises what the flow raised (ConfigError naming the field, a StageError, ...); a kernel
    interrupt raises KeyboardInterrupt once the workers stopped, and the same call resumes."""
    cfg = resolve(
        config,
        data=data,
        eval_data=eval_data,
        rewards=rewards,
        eval_rewards=eval_rewards,
        tools=tools,
        environment=environment,
        environment_kwargs=environment_kwargs,
        model=model,
        run_name=run_name,
        overrides=overrides,
        **settings,
    )
    _prefect_defaults()
    # Not under imports_without_gc, as the CLI imports them: its gc.freeze() would keep the kernel's
    # objects, the user's, out of every later collection.
    from prefect.settings import PREFECT_API_URL, temporary_settings  # Prefect, after _prefect_defaults

    from flows.local_server import kernel_server  # Prefect, after _prefect_defaults
    from flows.pipeline import grpo_pipeline  # Prefect, after _prefect_defaults

    clear_interrupt()  # an earlier run of this kernel was interrupted: this one runs
    url = kernel_server()
    log.info("run %s: %s", cfg.name, cfg.run_url)
    params = {k: v for k, v in cfg.to_dict().items() if k != "versions"}  # the flow finds the versions itself
    server = temporary_settings(updates={PREFECT_API_URL: url}) if url else contextlib.nullcontext()
    try:
        with _interruptible(), _progress(cfg, progress), server:
            summary = grpo_pipeline.with_options(retries=cfg.pipeline.flow_retries)(params)
    except KeyboardInterrupt as exc:  # the kernel's interrupt (or RunInterrupted, saying where it resumes)
        raise KeyboardInterrupt(f"{exc or 'interrupted'}; the same call resumes the run: {cfg.run_url}") from exc
    return Run(cfg.run_url, summary)


def resolve(
    config: RunConfig | Mapping[str, Any] | str | os.PathLike | None = None,
    *,
    data: Any = None,
    eval_data: Any = None,
    rewards: list[Any] | None = None,
    eval_rewards: list[Any] | None = None,
    tools: list[Any] | None = None,
    environment: Any = None,
    environment_kwargs: Mapping[str, Any] | None = None,
    model: str | None = None,
    run_name: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    **settings: Any,
) -> RunConfig:
    """The run config `train` runs with these arguments, resolved as the flow resolves it (the
    sources' versions; `.run_url` is the run's folder): in-memory data and callables are written
    under storage.root on the way. ConfigError names what is wrong."""
    values = _given(config)
    for key, value in {**(overrides or {}), **settings}.items():
        _set(values, key, value)
    if model is not None:
        _set(values, "model.path", os.fspath(model))
    if run_name is not None:
        values["run_name"] = run_name
    storage = RunConfig.from_dict({"storage": values.get("storage") or {}}).storage_url
    if data is not None:
        _set_data(values, data, storage)
    if eval_data is not None:
        _set(values, "data.eval_source", _source(eval_data, storage, "eval"))
    if rewards is not None:
        values["rewards"] = list(rewards)
    if eval_rewards is not None:
        _set(values, "eval.rewards", list(eval_rewards))
    for where in ("rewards", "eval.rewards"):
        specs = _get(values, where)
        if isinstance(specs, (list, tuple)):
            _set(values, where, [_reward_spec(item, i, storage, where) for i, item in enumerate(specs)])
    if tools is not None:
        _set(values, "train.agent.tools", list(tools))
    if environment is not None:
        _set(values, "train.agent.environment", environment)
    if environment_kwargs is not None:
        _set(values, "train.agent.environment_kwargs", dict(environment_kwargs))
    _agent_by_value(values, storage)
    cfg = RunConfig.from_dict(absolute_paths(values))
    if cfg.train.agent.enabled:  # each tool has a schema, the environment a reset: now, naming the field
        from grpo_core.agent.tools import load_toolbox  # transformers' schema reader: only an agentic run needs it

        load_toolbox(cfg.train.agent)
    config_rewards(cfg)  # each reward loads and takes (prompts, completions, **columns), names unique: now
    cfg = cfg.with_run_name(datetime.datetime.now(datetime.timezone.utc))
    return resolve_run(cfg, warn=log.warning)


def _given(config: Any) -> dict[str, Any]:
    """The config's values as a mapping of the YAML's shape."""
    if config is None:
        return {}
    if isinstance(config, RunConfig):
        return {k: v for k, v in config.to_dict().items() if k != "versions"}
    if isinstance(config, (str, os.PathLike)):
        return read_config(os.fspath(config))
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    raise ConfigError(f"config must be a RunConfig, a mapping or a YAML file's path, got {type(config).__name__}")


def _get(values: dict[str, Any], dotted: str) -> Any:
    node: Any = values
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _set(values: dict[str, Any], dotted: str, value: Any) -> None:
    """values[a][b][c] = value for "a.b.c" (the CLI's --set a.b.c=..., with a Python value)."""
    parts, node = dotted.split("."), values
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {part!r} is not a section")
    node[parts[-1]] = value


def _set_data(values: dict[str, Any], data: Any, storage: str) -> None:
    """data.source (and data.eval_source) for `data`: rows in memory written under `storage`."""
    section = values.setdefault("data", {})
    if not is_in_memory(data):
        section["source"] = os.fspath(data)
        return
    # the splits are chosen here; the files written are single tables
    train_rows, eval_rows = split_rows(data, section.pop("split", None), section.pop("eval_split", None))
    section["source"] = write_rows(train_rows, storage, "train")
    if eval_rows is not None:
        section["eval_source"] = write_rows(eval_rows, storage, "eval")


def _source(data: Any, storage: str, split: str) -> str:
    return write_rows(rows_of(data, f"{split}_data"), storage, split) if is_in_memory(data) else os.fspath(data)


def _reward_spec(item: Any, index: int, storage: str, where: str) -> Any:
    """A reward as the config holds it ({function, weight, params}), a callable pickled on the way."""
    if isinstance(item, tuple) and len(item) == 2:
        item = {"function": item[0], "weight": item[1]}
    if callable(item):
        item = {"function": item}
    if isinstance(item, dict) and callable(item.get("function")):
        fn = item["function"]
        return dict(item, function=save_reward(fn, storage, reward_name(fn, index)))
    if hasattr(item, "to_dict"):  # a RewardSpec
        return item.to_dict()
    return item  # a name, a spec or a mapping: the config validates it, naming {where}[{index}]


def _agent_by_value(values: dict[str, Any], storage: str) -> None:
    """train.agent's tools and environment given as Python objects, pickled by value into specs
    (grpo_core.rewards.by_value); names and specs as they are, for the config to validate."""
    tools = _get(values, "train.agent.tools")
    if isinstance(tools, (list, tuple)):
        specs = []
        for i, tool in enumerate(tools):
            if inspect.isclass(tool):
                raise ConfigError(
                    f"train.agent.tools[{i}] is the class {tool.__name__}: a tool is a function; a class whose "
                    "methods are tools is an environment (environment=...)"
                )
            specs.append(save_code(tool, storage, reward_name(tool, i, "tool"), "tool") if callable(tool) else tool)
        _set(values, "train.agent.tools", specs)
    env = _get(values, "train.agent.environment")
    if env is not None and not isinstance(env, str):
        if not inspect.isclass(env):
            raise ConfigError(
                f"train.agent.environment must be a class (one instance per episode) or its spec "
                f"('path/to/file.py:Class', 'module:Class', a built-in's name), got a {type(env).__name__}"
            )
        _set(values, "train.agent.environment", save_code(env, storage, env.__name__, "environment"))


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """A kernel interrupt (SIGINT) while the flow runs: the first stops the running stage's workers
    at their next step boundary, where they save a checkpoint (tasks.process.request_interrupt),
    and the flow ends with RunInterrupted; a second kills them and raises at once. The kernel
    lives on (the CLI's handler exits its process instead). Only the main thread receives signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    count, ended = 0, None

    def stuck(seconds: float) -> None:  # the flow has not ended that long after its workers stopped
        log.warning("the run has not ended %g s after its workers stopped: interrupting it now", seconds)
        _thread.interrupt_main()  # the handler below, a second time

    def handler(signum: int, _frame: Any) -> None:
        nonlocal count, ended
        count += 1
        if count > 1:
            kill_live_workers()
            raise RunInterrupted("interrupted again: the workers were killed; the same call resumes the run")
        live = request_interrupt()
        ended = watch_the_stop(stuck)
        log.warning(
            "interrupted: stopping the run%s; interrupt again to stop at once",
            " (its workers save a checkpoint at the next step boundary, within ~10 s)" if live else "",
        )
        if not live:  # no worker to wait for: stop the in-process stage where it is
            raise RunInterrupted("interrupted")

    old = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        if ended is not None:
            ended.set()
        signal.signal(signal.SIGINT, old)


@contextlib.contextmanager
def _progress(cfg: RunConfig, show: bool) -> Iterator[None]:
    """A bar of the run's training steps, fed by the workers' events (tasks.process.add_listener)."""
    if not show:
        yield
        return
    from tqdm.auto import tqdm  # optional display: Jupyter's widget where there is one, text elsewhere

    bar: list[Any] = []

    def on_event(e: dict[str, Any]) -> None:
        kind = e.get("event")
        if kind in ("start", "resumed") and not bar:
            bar.append(tqdm(total=cfg.train.num_steps, initial=int(e["step"]), desc=f"GRPO {cfg.name}", unit="step"))
        elif kind == "step" and bar:
            bar[0].set_postfix(reward=f"{e['reward']:.3f}", refresh=False)
            bar[0].update(int(e["step"]) + 1 - bar[0].n)
        elif kind == "eval" and bar:
            bar[0].set_postfix(step=e["step"], accuracy=f"{e['accuracy']:.3f}")

    stop: Callable[[], None] = add_listener(on_event)
    try:
        yield
    finally:
        stop()
        if bar:
            bar[0].close()
