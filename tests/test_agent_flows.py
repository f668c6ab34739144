"""Agentic GRPO everywhere a run starts (issue 62): `grpo demo --task tools`, flows.train with a tool
function and an environment class of a notebook's cell pickled by value (a run whose evaluations
hold episodes, the same call again resuming it, an edited body a new run), a class of `__main__`
carried to another process, the everyday form's tools field, and the trust policy refusing pickled
tools and environments and tool files outside the allowed folders from a deployment."""

import argparse
import json
import linecache
import pathlib
import subprocess
import sys

import pytest

from grpo_core.config.agent import AgentConfig
from grpo_core.config.run import DEMO_TASKS, RunConfig, load_config
from grpo_core.errors import ConfigError
from grpo_core.rewards.by_value import digest, save_code
from grpo_core.rewards.trust import TrustPolicy
from tests.test_notebook import _trained

ROOT = pathlib.Path(__file__).resolve().parents[1]

# A notebook's cell: a tool function and a small stateful environment (TRL's environment_factory
# shape) whose reward is its own get_reward()
CELL = '''
def double(n: int) -> int:
    """Double a number.

    Args:
        n: The number to double.
    """
    return 2 * int(n)


class Counter:
    """A running total the model adds to."""

    def __init__(self, start: int = 0):
        self.start = start

    def reset(self, **row):
        self.total = self.start

    def add(self, n: int) -> int:
        """Add a number to the running total.

        Args:
            n: The number to add.
        """
        self.total += int(n) * SCALE
        return self.total

    def get_reward(self) -> float:
        return float(self.total > self.start)
'''


def _cell(source: str, cell: int, scale: int = 1) -> dict:
    """What a notebook's cell defines: compiled from a file name of its own (IPython's
    `/tmp/ipykernel_*/N.py`), its text in linecache as IPython keeps it, in `__main__`, where
    Python keeps no text of a class (inspect finds none: a notebook's __main__ has no file)."""
    filename = f"/tmp/ipykernel_agent_test/{cell}.py"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"__name__": "__main__", "SCALE": scale}
    exec(compile(source, filename, "exec"), namespace)
    return namespace


# -- grpo demo --task ---------------------------------------------------------------------------


def test_grpo_demo_runs_a_demo_task_over_the_default(tmp_path, capsys):
    """`grpo demo --task tools` runs DEMO_TASKS["tools"] over the embedded default (a config file
    and --set over it); `grpo demo` is the run it always was; --help lists the tasks."""
    from flows.cli import _config, demo_config, main

    default = load_config(None, [])
    tools = demo_config("tools")
    assert tools.to_dict() == RunConfig.from_dict(DEMO_TASKS["tools"]).to_dict()
    agent = tools.train.agent
    assert (agent.environment, agent.max_turns, agent.max_tokens) == ("codebook", 2, 16)
    assert tools.data.synthetic["task"] == "codebook" and tools.train.sampling.max_new_tokens == 4
    assert [r.function for r in tools.rewards] == ["char_match", "tool_called", "exact_match"]
    # what the task leaves alone is the default's
    assert tools.model.to_dict() == default.model.to_dict() and tools.train.grpo == default.train.grpo
    assert tools.name != default.name
    # grpo demo (the reverse task): the same config, the same run
    assert demo_config("reverse").to_dict() == default.to_dict() and demo_config("reverse").name == "tiny-ecc6c5c9"
    ns = argparse.Namespace(command="demo", task="reverse", config=None, set=[])
    assert _config(ns).name == "tiny-ecc6c5c9"
    # a config file and --set go over the task, the task's other keys kept
    (tmp_path / "over.yaml").write_text("train:\n  agent:\n    max_tokens: 12\n")
    over = demo_config("tools", str(tmp_path / "over.yaml"), ["train.agent.max_turns=3", "train.num_steps=4"])
    assert (over.train.agent.environment, over.train.agent.max_turns, over.train.agent.max_tokens) == (
        "codebook",
        3,
        12,
    )
    assert over.train.num_steps == 4 and [r.function for r in over.rewards] == [r.function for r in tools.rewards]
    ns = argparse.Namespace(command="demo", task="tools", config=None, set=["train.num_steps=4"])
    assert _config(ns).name == demo_config("tools", None, ["train.num_steps=4"]).name
    capsys.readouterr()
    assert main(["demo", "--task", "nope", "--set", f"storage.root={tmp_path}"]) == 2  # before any server starts
    assert "--task 'nope' is not a demo task (reverse, tools)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    helped = " ".join(capsys.readouterr().out.split())
    assert "--task TASK the demo task (default: reverse)" in helped
    assert "reverse (the embedded default, reverse a word); tools (the synthetic tool task" in helped


def test_an_episode_reads_as_one_line():
    """What `grpo demo` prints for an agentic run's held-out examples: each turn, call and result."""
    from flows.cli import episode_text

    call = lambda name, args: {"type": "function", "function": {"name": name, "arguments": args}}  # noqa: E731
    solved = [
        {"role": "assistant", "content": "", "tool_calls": [call("code", {})]},
        {"role": "tool", "name": "code", "content": "006"},
        {"role": "assistant", "content": "006"},
    ]
    assert episode_text(solved) == "call code() -> 006 -> answer 006"
    mixed = [
        {"role": "assistant", "content": "let me add", "tool_calls": [call("add", {"_0": "3"}), call("x", {"n": 2})]},
        {"role": "tool", "name": "add", "content": "3"},
        {"role": "tool", "name": "x", "content": "error: unknown tool 'x'"},
        {"role": "assistant", "content": ""},
    ]
    assert episode_text(mixed) == (
        "says 'let me add' -> call add(3) -> call x(n=2) -> 3 -> \"error: unknown tool 'x'\" -> answer ''"
    )
    assert episode_text([{"role": "assistant", "content": "5#", "tool_calls": [call("add", {"_0": "5"})]}]) == (
        "says 5# -> call add(5)"  # a call the episode had no turn left to read: no result
    )
    assert episode_text([]) == "(nothing)"


# -- tools and environments by value ------------------------------------------------------------


def test_a_cells_tool_and_environment_are_named_by_what_they_do(tmp_path):
    """A class of a notebook's cell has no text Python keeps: its digest is its members' (its methods'
    text and what they reach), so the same cell again names the same pickle, and an edit of a method
    or of a global a method reads another. Pickled by value, it loads with no module of the cell's."""
    first, again = _cell(CELL, 1), _cell(CELL, 2)
    assert digest(first["Counter"]) == digest(again["Counter"]) and digest(first["double"]) == digest(again["double"])
    edited = _cell(CELL.replace("self.total += int(n)", "self.total -= int(n)"), 3)
    assert digest(edited["Counter"]) != digest(first["Counter"])  # a method's body
    assert digest(edited["double"]) == digest(first["double"])  # the function beside it: unchanged
    assert digest(_cell(CELL, 4, scale=2)["Counter"]) != digest(first["Counter"])  # a global a method reads
    assert digest(_cell(CELL.replace("2 * int(n)", "3 * int(n)"), 5)["double"]) != digest(first["double"])

    env_spec = save_code(first["Counter"], str(tmp_path), "Counter", "environment")
    tool_spec = save_code(first["double"], str(tmp_path), "double", "tool")
    assert env_spec == f"{tmp_path}/_inputs/environments/{digest(first['Counter'])}/Counter.pkl:Counter"
    assert tool_spec == f"{tmp_path}/_inputs/tools/{digest(first['double'])}/double.pkl:double"
    assert save_code(again["Counter"], str(tmp_path), "Counter", "environment") == env_spec  # written once
    text = (tmp_path / "_inputs" / "environments" / digest(first["Counter"]) / "Counter.py").read_text()
    assert "self.total += int(n) * SCALE" in text  # its methods' text beside the pickle, to read
    with pytest.raises(TypeError, match="environment 'double' is a function, not a class"):
        save_code(first["double"], str(tmp_path), "double", "environment")
    with pytest.raises(TypeError, match="tool 'Counter' is a type, not a function"):
        save_code(first["Counter"], str(tmp_path), "Counter", "tool")
    _loads_as_a_toolbox(tool_spec, env_spec)


def _loads_as_a_toolbox(tool_spec: str, env_spec: str) -> None:
    """The pickles load as the workers load them: the function's and the methods' schemas from their
    docstrings, an environment per episode whose state moves call by call and scores itself."""
    from grpo_core.agent.tools import load_toolbox

    box = load_toolbox(AgentConfig(tools=(tool_spec,), environment=env_spec, environment_kwargs={"start": 1}))
    assert box.names == ["double", "add"] and box.owns_reward
    assert box.tools[0].schema["function"]["description"] == "Double a number."
    assert box.env_tools[0].parameters == ["n"]
    env = box.new_env()
    env.reset(prompt="abc?")
    assert (env.add("2"), env.add(3), env.get_reward(), box.tools[0].fn("4")) == (3, 6, 1.0, 8)


def test_a_class_of_main_travels_by_value_to_another_process(tmp_path):
    """A script's (or a kernel's) `__main__` class and function: pickled by value in one process and
    loaded in another, where no module of theirs exists; the same script again names the same pickles."""
    script = tmp_path / "cell.py"
    script.write_text(
        "import sys\nfrom grpo_core.rewards.by_value import save_code\nSCALE = 1\n"
        + CELL
        + "\nprint(save_code(double, sys.argv[1], 'double', 'tool'))"
        + "\nprint(save_code(Counter, sys.argv[1], 'Counter', 'environment'))\n"
    )

    def pickled() -> list[str]:
        out = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "store")],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split()

    specs = pickled()
    assert pickled() == specs and "/_inputs/environments/" in specs[1]  # another process: the same digests
    _loads_as_a_toolbox(*specs)


def test_a_deployment_refuses_a_pickled_tool_and_environment(tmp_path):
    """flows.train's tools and environment pickled by value run locally only: the trust policy
    refuses either from a deployment, naming the field, whatever the operator allows."""
    from flows.notebook import resolve

    ns = _cell(CELL, 6)
    settings = {"storage.root": str(tmp_path / "runs"), "train.num_steps": 4}
    policy = TrustPolicy.from_env(
        {"GRPO_REWARD_PATHS": str(tmp_path / "runs"), "GRPO_ALLOW_ROOTS": str(tmp_path / "runs")}, cwd=str(tmp_path)
    )
    cfg = resolve(tools=[ns["double"], "calculator"], environment=ns["Counter"], **settings)
    assert cfg.train.agent.tools[1] == "calculator" and cfg.train.agent.tools[0].endswith("/double.pkl:double")
    with pytest.raises(ConfigError, match=r"\(1\) train\.agent\.tools\[0\] '.*/double\.pkl:double' may not run in a "):
        policy.check(cfg, cwd=str(tmp_path))  # under an allowed folder, and still refused: unpickling runs code
    cfg = resolve(tools=["calculator"], environment=ns["Counter"], **settings)
    with pytest.raises(ConfigError, match=r"^train\.agent\.environment '.*/Counter\.pkl:Counter' may not run in a de"):
        policy.check(cfg, cwd=str(tmp_path))
    policy.check(resolve(tools=["calculator"], environment="codebook", **settings), cwd=str(tmp_path))  # built-ins
    with pytest.raises(ConfigError, match=r"train\.agent\.tools\[0\] is the class Counter: a tool is a function"):
        resolve(tools=[ns["Counter"]], **settings)
    with pytest.raises(ConfigError, match=r"train\.agent\.environment must be a class .* got a function"):
        resolve(environment=ns["double"], **settings)
    undocumented = _cell(CELL.replace('    """Double a number.', '    """'), 7)
    with pytest.raises(ConfigError, match=r"train\.agent\.tools\[0\]: 'double' cannot be described to the model"):
        resolve(tools=[undocumented["double"]], **settings)  # before any run: the schema is its docstring


# -- the everyday form ---------------------------------------------------------------------------


def test_the_everyday_forms_tools_field_sets_train_agent_tools_through_the_trust_policy(tmp_path):
    """grpo-pipeline/train's Tools: a list of specs, described as Rewards is, setting train.agent.tools
    as --set does; from a deployment, a tool file outside the allowed folders is refused naming
    train.agent.tools[0], one inside them and the built-ins pass."""
    from prefect.utilities.schema_tools import validate

    from flows.everyday import everyday_config, everyday_defaults, grpo_train

    schema = grpo_train.parameters.model_dump()
    prop = schema["properties"]["tools"]
    assert (prop["title"], prop["type"], prop["items"], prop["position"]) == ("Tools", "array", {"type": "string"}, 5)
    assert "path/to/file.py:function or module:function" in prop["description"]
    assert "Built-in: calculator." in prop["description"]
    assert "Empty: the default for this config" in prop["description"]
    assert validate({"tools": ["calculator"]}, schema, raise_on_error=False) == []
    assert validate({"tools": "calculator"}, schema, raise_on_error=False)  # not a list: refused by the server
    got = everyday_config({"tools": ["calculator"], "num_steps": 4})
    assert got.to_dict() == load_config(None, ["train.agent.tools=[calculator]", "train.num_steps=4"]).to_dict()
    assert not everyday_config({"tools": []}).train.agent.enabled  # empty: the default, no episodes
    assert everyday_defaults({"train": {"agent": {"tools": ["calculator"]}}}) == ({"tools": ["calculator"]}, [])

    (tmp_path / "rewards").mkdir()
    (tmp_path / "elsewhere").mkdir()
    tool = (
        'def lookup(key: str) -> str:\n    """Look a key up.\n\n    Args:\n        key: It.\n    """\n    return key\n'
    )
    for folder in ("rewards", "elsewhere"):
        (tmp_path / folder / "tools.py").write_text(tool)
    policy = TrustPolicy.from_env({}, cwd=str(tmp_path))  # the default: ./rewards of the flow's folder
    outside = everyday_config({"tools": [f"{tmp_path}/elsewhere/tools.py:lookup"]})
    with pytest.raises(ConfigError) as refused:
        policy.check(outside, cwd=str(tmp_path))
    assert str(refused.value).startswith(
        f"train.agent.tools[0] '{tmp_path}/elsewhere/tools.py:lookup' may not run in a deployment run: the file "
        f"{tmp_path}/elsewhere/tools.py is not under an allowed reward folder (allowed: {tmp_path}/rewards)"
    )
    policy.check(everyday_config({"tools": [f"{tmp_path}/rewards/tools.py:lookup", "calculator"]}), cwd=str(tmp_path))
    with pytest.raises(ConfigError, match=r"train\.agent\.tools\[0\] 'os:system' may not run in a deployment run"):
        policy.check(everyday_config({"tools": ["os:system"]}), cwd=str(tmp_path))


# -- flows.train, end to end ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_flows_train_runs_episodes_with_a_cells_tool_and_environment_and_resumes(tmp_path, capsys):
    """flows.train(tools=[a cell's function, a built-in], environment=a cell's class): the workers load
    both by value and run episodes (the plain format: a call is a turn ending with `#`); the metrics
    count each tool's calls and the environment's own reward; the evaluations' examples hold the
    episodes, which grpo demo prints. The same cell run again resumes the run (nothing trained); an
    edited tool or method is a new run."""
    from flows.cli import _print_examples, episode_text
    from flows.notebook import resolve, train

    settings = {
        "storage.root": str(tmp_path / "runs"),
        "train.num_steps": 4,
        "train.grpo.prompts_per_step": 4,
        "train.grpo.num_generations": 4,
        "train.sampling.max_new_tokens": 4,
        "train.agent.max_turns": 2,
        "train.agent.max_tokens": 32,  # room for a tool's result and a turn after it
        "data.synthetic_rows": 32,
        "data.eval_rows": 4,
        "eval.num_samples": 1,
        "pipeline.epochs": 1,
    }

    def call(cell: int, source: str = CELL):
        ns = _cell(source, cell)
        return dict(tools=[ns["double"], "calculator"], environment=ns["Counter"], environment_kwargs={"start": 1})

    run = train(**call(8), progress=False, **settings)
    assert run.summary["status"] == "completed" and run.summary["steps"] == 4, run.summary
    config = json.loads((pathlib.Path(run.url) / "config.json").read_text())
    agent = config["train"]["agent"]
    assert agent["tools"][0].startswith(f"{tmp_path}/runs/_inputs/tools/") and agent["tools"][1] == "calculator"
    assert agent["environment"].startswith(f"{tmp_path}/runs/_inputs/environments/")
    assert agent["environment"].endswith("/Counter.pkl:Counter") and agent["environment_kwargs"] == {"start": 1}
    metrics = run.metrics
    for key in ("rewards/Counter/mean", "tools/double/calls", "tools/calculator/calls", "tools/add/calls"):
        assert key in metrics, sorted(metrics)
    assert metrics["turns_per_episode"].between(1, 2).all()
    # the random policy ends some turns with `#`: calls, whose results (errors: with three tools a call
    # names its tool, which it does not) join the episode, and the model takes its second turn
    assert metrics["tool_calls_per_episode"].sum() > 0 and (metrics["turns_per_episode"] > 1).any(), metrics
    evals = run.evals
    assert [e["step"] for e in evals] == [0, 4] and "Counter" in evals[-1]["greedy"]
    for e in evals:
        assert e["examples"] and all(x["episode"][0]["role"] == "assistant" for x in e["examples"]), e["examples"]
    capsys.readouterr()
    _print_examples(run.url)
    printed = capsys.readouterr().out
    first = evals[0]["examples"][0]
    assert "held-out prompts, greedy episodes at step 0 and step 4:" in printed
    assert f"    step 0: {episode_text(first['episode'])}\n" in printed, printed
    trained = _trained(pathlib.Path(run.url))

    again = train(**call(9), progress=False, **settings)  # the cell run again (a new kernel: other cell files)
    assert again.url == run.url and _trained(pathlib.Path(run.url)) == trained
    assert again.summary["last_invocation"]["did_work"] is False, again.summary
    edited_tool = resolve(**call(10, CELL.replace("2 * int(n)", "3 * int(n)")), **settings)
    edited_env = resolve(**call(11, CELL.replace("float(self.total > self.start)", "1.0")), **settings)
    assert len({run.url, edited_tool.run_url, edited_env.run_url}) == 3
