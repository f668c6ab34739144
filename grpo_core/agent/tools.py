"""What the model may call in an episode, and how a call runs.

A tool is a plain function, as TRL takes them: its name, type hints and Google-style docstring are
its schema (transformers' own `get_json_schema`, which the chat template renders). An environment
is a class, as TRL's `environment_factory` makes them: one instance per episode, `reset(**row)`
first (its return, when it is text, joins the prompt), its public methods the episode's tools
(state kept across turns), an optional `get_reward()` that scores the episode, and `close()` at
the end. Anything a TRL environment class has, this accepts.

A call runs in a thread of its own, bounded by train.agent.tool_timeout_s: an exception, a
timeout or arguments that do not fit become the tool message's text ("error: ..."), the episode
goes on and the metrics count it. Python cannot stop a call that never returns: it is abandoned (a
daemon thread, which never holds the process open) and the episode goes on without it.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import threading
import time
from typing import Any, Callable, Sequence

from grpo_core.agent.builtin import BUILTIN_ENVIRONMENTS, BUILTIN_TOOLS
from grpo_core.code import load_code
from grpo_core.config.agent import AgentConfig
from grpo_core.errors import ConfigError

log = logging.getLogger(__name__)

# Members of an environment that are its protocol, not tools (TRL's `reset` and `get_reward`; `close`)
ENV_PROTOCOL = ("reset", "get_reward", "close")


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}
    where: str = ""  # the config field naming it, for messages

    @property
    def parameters(self) -> list[str]:
        return list(self.schema["function"].get("parameters", {}).get("properties", {}))


@dataclasses.dataclass(frozen=True)
class CallResult:
    name: str
    arguments: dict[str, Any] | None
    content: str  # what the tool message says
    error: bool
    seconds: float


def schema_of(fn: Callable[..., Any], where: str) -> dict[str, Any]:
    """The function's JSON schema from its type hints and docstring (transformers.utils.get_json_schema,
    as TRL reads tools), or ConfigError naming `where` and what is missing."""
    from transformers.utils import get_json_schema  # heavy: only a run with tools needs it

    try:
        return get_json_schema(fn)
    except Exception as exc:  # noqa: BLE001 - transformers raises its own types for a missing hint or doc
        raise ConfigError(
            f"{where}: {getattr(fn, '__name__', fn)!r} cannot be described to the model: {exc}. A tool's schema is "
            "its type hints and its docstring (Google style: a summary line, then an Args: section naming every "
            "parameter), as TRL and transformers read them"
        ) from None


def tools_of(fns: Sequence[tuple[str, Callable[..., Any]]]) -> list[Tool]:
    """Tool objects of (field, function) pairs, their names unique."""
    out = [Tool(getattr(fn, "__name__", ""), fn, schema_of(fn, where), where) for where, fn in fns]
    names = [t.name for t in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"train.agent: two tools are named {dup[0]!r} ({', '.join(t.where for t in out)})")
    return out


def environment_tools(env: Any, where: str = "train.agent.environment") -> list[tuple[str, Callable[..., Any]]]:
    """An environment instance's tools: its public methods, its protocol (reset, get_reward, close) aside."""
    return [
        (f"{where} ({type(env).__name__}.{name})", member)
        for name, member in inspect.getmembers(env, predicate=inspect.ismethod)
        if not name.startswith("_") and name not in ENV_PROTOCOL
    ]


@dataclasses.dataclass
class Toolbox:
    """The tools of a run (train.agent.tools) and its environment class, loaded."""

    tools: list[Tool]
    env_class: type | None = None
    env_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    env_tools: list[Tool] = dataclasses.field(default_factory=list)  # the schema of an environment's methods

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """Every tool an episode may see, as the chat template renders them."""
        return [t.schema for t in [*self.tools, *self.env_tools]]

    @property
    def names(self) -> list[str]:
        return [t.name for t in [*self.tools, *self.env_tools]]

    @property
    def owns_reward(self) -> bool:
        return self.env_class is not None and callable(getattr(self.env_class, "get_reward", None))

    def new_env(self) -> Any:
        return None if self.env_class is None else self.env_class(**self.env_kwargs)

    def episode(self, env: Any) -> dict[str, Tool]:
        """The tools one episode may call: the run's, and its environment instance's methods (bound)."""
        own = {t.name: t for t in self.tools}
        if env is not None:
            schemas = {t.name: t.schema for t in self.env_tools}
            for where, fn in environment_tools(env):
                name = fn.__name__
                own[name] = Tool(name, fn, schemas.get(name) or schema_of(fn, where), where)
        return own


def load_toolbox(agent: AgentConfig, pickled_ok: bool = True) -> Toolbox:
    """The run's tools and environment class (built-ins by name, `file.py:fn`, `module:fn`), or
    ConfigError naming the field: a missing file or name, a tool that is not a function with a
    schema, an environment without reset. The environment class is instantiated once here to read
    its methods' schemas (TRL does the same), and closed."""

    def load(spec: str, where: str, what: str, builtins: dict[str, Any]) -> Any:
        if spec in builtins:
            return builtins[spec]
        if ":" not in spec:
            raise ConfigError(
                f"{where} {spec!r} is not a built-in {what} ({', '.join(sorted(builtins)) or 'none'}) nor "
                f"'path/to/file.py:name' / 'module:name'"
            )
        try:
            return load_code(spec, what)
        except (ImportError, FileNotFoundError, ValueError, AttributeError, SyntaxError) as exc:
            raise ConfigError(f"{where}: {exc}") from None

    fns = []
    for i, spec in enumerate(agent.tools):
        where = f"train.agent.tools[{i}]"
        fn = load(spec, where, "tool", BUILTIN_TOOLS)
        if not callable(fn) or inspect.isclass(fn):
            raise ConfigError(f"{where} {spec!r} is a {type(fn).__name__}, not a function")
        fns.append((where, fn))
    box = Toolbox(tools_of(fns))
    if agent.environment is not None:
        where = "train.agent.environment"
        cls = load(agent.environment, where, "environment", BUILTIN_ENVIRONMENTS)
        if not inspect.isclass(cls):
            raise ConfigError(f"{where} {agent.environment!r} is a {type(cls).__name__}, not a class")
        if not callable(getattr(cls, "reset", None)):
            raise ConfigError(
                f"{where} {agent.environment!r}: {cls.__name__} has no reset method; an environment is a class with "
                "reset(**row) (returning the first observation, or nothing), whose public methods are its tools"
            )
        kwargs = dict(agent.environment_kwargs or {})
        try:
            probe = cls(**kwargs)
        except Exception as exc:  # noqa: BLE001 - a user's constructor
            raise ConfigError(f"{where}: {cls.__name__}(**train.agent.environment_kwargs) raised {exc!r}") from None
        try:
            env_tools = tools_of(environment_tools(probe, where))
        finally:
            close_env(probe)
        clash = sorted(set(t.name for t in env_tools) & set(box.names))
        if clash:
            raise ConfigError(
                f"{where}: {cls.__name__}'s method {clash[0]!r} has the name of a tool in train.agent.tools"
            )
        box = dataclasses.replace(box, env_class=cls, env_kwargs=kwargs, env_tools=env_tools)
    if not box.names:
        raise ConfigError(
            "train.agent: an environment without public methods and no train.agent.tools: the model has nothing to call"
        )
    return box


def close_env(env: Any) -> None:
    close = getattr(env, "close", None)
    if callable(close):
        try:
            close()
        except Exception as exc:  # noqa: BLE001 - a user's close: reported, the run goes on
            log.warning("environment %s.close() raised %r", type(env).__name__, exc)


def _convert(tool: Tool, arguments: dict[str, Any]) -> dict[str, Any]:
    """Arguments checked against the tool's parameters: an unknown or missing one is an error the
    model reads (TypeError), as a wrong call to the function would be."""
    params = inspect.signature(tool.fn).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    unknown = [k for k in arguments if k not in params and not takes_any]
    if unknown:
        raise TypeError(f"{tool.name}() takes no argument {unknown[0]!r}; it takes {', '.join(tool.parameters)}")
    return arguments


def result_text(value: Any, most: int) -> str:
    """A tool's return as the tool message's text: strings as they are, other values as JSON
    (else str), cut at `most` characters."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            text = str(value)
    return text if len(text) <= most else text[:most] + f"... (cut at {most} characters)"


def run_calls(
    calls: Sequence[tuple[Tool | None, str, dict[str, Any] | None, str | None]], timeout_s: float, most: int
) -> list[CallResult]:
    """One episode's calls of a turn, in order (an environment's state moves call by call): each
    (tool or None when unknown, its name, arguments, a parse error) -> CallResult."""
    out = []
    for tool, name, arguments, problem in calls:
        t0 = time.perf_counter()
        if problem is not None or tool is None or arguments is None:
            why = problem or f"unknown tool {name!r}"
            out.append(CallResult(name, arguments, f"error: {why}", True, 0.0))
            continue
        box: dict[str, Any] = {}

        def run(tool=tool, arguments=arguments, box=box) -> None:
            try:
                box["value"] = tool.fn(**_convert(tool, arguments))
            except BaseException as exc:  # noqa: BLE001 - any failure is the model's to read
                box["error"] = exc

        thread = threading.Thread(target=run, name=f"tool-{name}", daemon=True)
        thread.start()
        thread.join(timeout_s)
        seconds = time.perf_counter() - t0
        if thread.is_alive():
            log.warning("tool %s did not return within %g s (train.agent.tool_timeout_s): abandoned", name, timeout_s)
            out.append(
                CallResult(name, arguments, f"error: {name} did not return within {timeout_s:g} s", True, seconds)
            )
        elif "error" in box:
            exc = box["error"]
            out.append(CallResult(name, arguments, f"error: {type(exc).__name__}: {exc}"[:most], True, seconds))
        else:
            out.append(CallResult(name, arguments, result_text(box["value"], most), False, seconds))
    return out


def run_episode_calls(
    batch: Sequence[Sequence[tuple[Tool | None, str, dict[str, Any] | None, str | None]]], timeout_s: float, most: int
) -> list[list[CallResult]]:
    """Each episode's calls (run_calls), the episodes side by side in threads of their own: a slow
    tool in one episode does not hold up another's. Deterministic tools give the same results in
    any order."""
    out: list[list[CallResult]] = [[] for _ in batch]
    if sum(len(c) for c in batch) <= 1:  # nothing to overlap
        return [run_calls(c, timeout_s, most) for c in batch]

    def one(i: int) -> None:
        out[i] = run_calls(batch[i], timeout_s, most)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i, c in enumerate(batch) if c]
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # each call inside is bounded by timeout_s: this returns
    return out
