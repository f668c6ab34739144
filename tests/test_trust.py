"""What a config from a deployment's parameters may name (grpo_core.rewards.trust): built-in
rewards, reward files under the allowed folders, modules allowed by name, program fields at their
defaults unless allowed. The run through a real deployment is in tests/test_deployments.py."""

import os

import pytest

from grpo_core.config.run import load_config
from grpo_core.errors import ConfigError
from grpo_core.rewards.registry import make_rewards
from grpo_core.rewards.trust import ENV_FIELDS, ENV_MODULES, ENV_PATHS, ENV_ROOTS, TrustPolicy

REWARD = "def score(prompts, completions, **kw):\n    return [1.0] * len(completions)\n"


def cfg(*sets):
    return load_config(None, list(sets))


@pytest.fixture
def project(tmp_path):
    """A project folder with its own rewards/ and a reward file elsewhere."""
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "mine.py").write_text(REWARD)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "theirs.py").write_text(REWARD)
    return tmp_path


@pytest.mark.parametrize("spec", ["pty:spawn", "subprocess:run", "os:popen", "shutil:rmtree", "builtins:exec"])
def test_standard_library_callables_are_refused_naming_the_field(spec, project):
    c = cfg(f'rewards=[{{function: "{spec}"}}]')
    make_rewards(c.rewards)  # the local user's loader takes it: its signature fits a reward's
    with pytest.raises(ConfigError) as err:
        TrustPolicy.from_env({}, cwd=str(project)).check(c, cwd=str(project))
    msg = str(err.value)
    assert msg.startswith(f"rewards[0].function {spec!r} may not run in a deployment run")
    assert "--allow-reward-module" in msg and ENV_PATHS in msg and "none is allowed" in msg


def test_builtins_and_the_project_reward_folder_are_allowed(project):
    policy = TrustPolicy.from_env({}, cwd=str(project))  # unset: ./rewards of the working directory
    assert policy.reward_paths == (os.path.realpath(project / "rewards"),)
    policy.check(cfg("rewards=[{function: char_match}, {function: math_answer, weight: 0}]"))
    policy.check(cfg(f'rewards=[{{function: "{project}/rewards/mine.py:score"}}]'))
    policy.check(cfg('rewards=[{function: "rewards/mine.py:score"}]'), cwd=str(project))  # relative to the flow's cwd
    assert TrustPolicy.from_env({}, cwd=str(project / "elsewhere")).reward_paths == ()  # no rewards/ there


@pytest.mark.parametrize(
    "where",
    ["elsewhere/theirs.py", "rewards/../elsewhere/theirs.py", "{root}/elsewhere/theirs.py", "rewards/link.py"],
)
def test_files_outside_the_allowed_folders_are_refused(where, project):
    (project / "rewards" / "link.py").symlink_to(project / "elsewhere" / "theirs.py")  # resolves outside
    spec = where.format(root=project) + ":score"
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.function .* is not under an allowed reward folder"):
        TrustPolicy.from_env({}, cwd=str(project)).check(cfg(f'rewards=[{{function: "{spec}"}}]'), cwd=str(project))


def test_eval_rewards_are_checked_and_named(project):
    c = cfg('eval.rewards=[{function: exact_match}, {function: "os:popen"}]', "eval.accuracy_reward=exact_match")
    with pytest.raises(ConfigError, match=r"^eval\.rewards\[1\]\.function 'os:popen'"):
        TrustPolicy.from_env({}, cwd=str(project)).check(c)


def test_operator_allows_folders_modules_and_functions_by_name(project):
    env = {
        ENV_PATHS: os.pathsep.join([str(project / "elsewhere"), "other"]),
        ENV_MODULES: "pty:spawn, my_pkg.rewards",
    }
    policy = TrustPolicy.from_env(env, cwd=str(project))
    # an explicit setting replaces the default folder
    assert policy.reward_paths == (os.path.realpath(project / "elsewhere"), os.path.realpath(project / "other"))
    for spec in ("pty:spawn", "my_pkg.rewards:f", "my_pkg.rewards.sub:f", f"{project}/elsewhere/theirs.py:score"):
        assert policy.reward_refusal(spec, cwd=str(project)) is None, spec
    for spec in ("pty:fork", "my_pkg:f", "my_pkg.rewards_evil:f", "rewards/mine.py:score"):
        assert policy.reward_refusal(spec, cwd=str(project)) is not None, spec
    # a module is checked by its name, never imported to check it
    assert TrustPolicy().reward_refusal("no_such_module_anywhere:f") is not None


def test_program_fields_stay_at_their_defaults_unless_allowed(project):
    python = cfg("pipeline.worker_python=/bin/sh")
    command = cfg("train.rollout.engine=http", 'train.rollout.server_command=["sh", "-c", "touch x; echo {model}"]')
    with pytest.raises(ConfigError, match=r"^pipeline\.worker_python='/bin/sh' may not be set .*--allow-field"):
        TrustPolicy().check(python)
    with pytest.raises(ConfigError, match=r"^train\.rollout\.server_command=.* names a program"):
        TrustPolicy().check(command)
    TrustPolicy.from_env({ENV_FIELDS: "pipeline.worker_python"}).check(python)
    with pytest.raises(ConfigError, match=f"{ENV_FIELDS} names"):
        TrustPolicy.from_env({ENV_FIELDS: "model.path"})


def test_grpo_serve_allows_what_the_operator_gave(project, monkeypatch):
    from flows.serve import allow_code

    for name in (ENV_PATHS, ENV_MODULES, ENV_FIELDS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(project)
    own = {"rewards": [{"function": f"{project}/elsewhere/theirs.py:score"}, {"function": "my_mod:f"}]}
    allow_code(["extra"], ["pkg.r"], ["pipeline.worker_python"], own)
    policy = TrustPolicy.from_env()
    assert policy.reward_paths == tuple(
        os.path.realpath(p) for p in (project / "rewards", project / "extra", project / "elsewhere" / "theirs.py")
    )
    assert policy.reward_modules == ("pkg.r", "my_mod:f") and policy.fields == ("pipeline.worker_python",)
    assert policy.reward_refusal(f"{project}/elsewhere/theirs.py:score") is None
    assert policy.reward_refusal(f"{project}/elsewhere/other.py:score") is not None
    with pytest.raises(ValueError, match="--allow-field 'model.path'"):
        allow_code([], [], ["model.path"])


def test_places_stay_where_the_deployment_has_them_unless_allowed(project):
    """issue 28: a run from the UI writes into no other folder or bucket and reads no other file of
    the machine: storage.root and the sources as the deployment's own config has them, or under a
    root the operator allowed; Hub ids, the synthetic task and run names are not places."""
    deployed = cfg(f"storage.root={project}/runs", f"data.source={project}/data/train.jsonl")
    TrustPolicy().check(deployed, baseline=deployed)  # the deployment's own places
    TrustPolicy().check(cfg("data.source=openai/gsm8k", "model.init_from=nightly-*"))  # a Hub id, a run name
    with pytest.raises(ConfigError, match=r"^storage\.root=.* may not be set in a deployment run: .*--allow-root"):
        TrustPolicy().check(cfg(f"storage.root={project}/.."), baseline=deployed)
    with pytest.raises(ConfigError, match=r"^data\.source='/etc/passwd\.jsonl' may not .* where this .* runs read"):
        TrustPolicy().check(cfg(f"storage.root={project}/runs", "data.source=/etc/passwd.jsonl"), baseline=deployed)
    policy = TrustPolicy()
    assert policy.place_refusal("model.path", "Qwen/Qwen2.5-0.5B", deployed) is None  # a Hub id
    for field, value in [
        ("data.eval_source", f"{project}/rewards/mine.py.jsonl"),
        ("model.path", "gs://someone-elses/model"),
        ("model.tokenizer", "./tok"),
        ("model.init_from", "gs://someone-elses/runs/x@4"),
    ]:
        assert "is not where this deployment's runs read" in policy.place_refusal(field, value, deployed), field
    # `..` is resolved before it is compared: runs/../x is not under runs
    with pytest.raises(ConfigError, match=r"^storage\.root=.* is not where this deployment's runs write"):
        TrustPolicy.from_env({ENV_ROOTS: f"{project}/runs"}, cwd=str(project)).check(cfg("storage.root=runs/../x"))
    allowed = TrustPolicy.from_env({ENV_ROOTS: f"{project}/shared,gs://someone-elses/runs"}, cwd=str(project))
    assert allowed.place_refusal("model.init_from", "gs://someone-elses/runs/x@4", deployed) is None
    allowed.check(cfg(f"storage.root={project}/shared/a", f"data.source={project}/shared/q.jsonl"), baseline=deployed)
    with pytest.raises(ConfigError, match=r"^storage\.root=.*allowed: .*/shared, gs://someone-elses/runs"):
        allowed.check(cfg("storage.root=gs://someone-elses/runs-2"), baseline=deployed)  # a prefix, not a folder


def test_grpo_serve_allow_root(project, monkeypatch):
    from flows.serve import allow_code

    monkeypatch.delenv(ENV_ROOTS, raising=False)
    monkeypatch.chdir(project)
    allow_code([], [], [], None, ["shared/runs", "gs://bucket/runs/"])
    assert TrustPolicy.from_env().roots == (os.path.realpath(project / "shared" / "runs"), "gs://bucket/runs")
    with pytest.raises(ValueError, match="may not contain ','"):
        allow_code([], [], [], None, ["a,b"])
