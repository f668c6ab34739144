"""What a config from a deployment's parameters may name (grpo_core.rewards.trust): built-in
rewards, reward files under the allowed folders, modules allowed by name, program and address
fields at their defaults unless allowed, places under the allowed roots, work within the limits;
and that every field of the typed config says what it names. The runs through real deployments
are in tests/test_attacks.py and tests/test_deployments.py."""

import os
import re

import pytest

from grpo_core.config.fields import Trust
from grpo_core.config.run import load_config
from grpo_core.errors import ConfigError
from grpo_core.rewards.registry import make_rewards
from grpo_core.rewards.trust import (
    ENV_FIELDS,
    ENV_HOSTS,
    ENV_LIMITS,
    ENV_MODULES,
    ENV_PATHS,
    ENV_ROOTS,
    TrustPolicy,
    declared,
    refused_job_variables,
)

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

    for name in (ENV_PATHS, ENV_MODULES, ENV_FIELDS, ENV_ROOTS, ENV_HOSTS, ENV_LIMITS):
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
    with pytest.raises(ValueError, match=r"--allow-field names \['model.path'\]"):
        allow_code([], [], ["model.path"])
    with pytest.raises(ValueError, match="--raise-limit 'model.path=1' must be FIELD=N"):
        allow_code([], [], [], None, None, None, ["model.path=1"])


def test_grpo_serve_anchors_its_own_configs_places_and_addresses(project, monkeypatch):
    """What the served config names itself (its storage root, its data, its server) is what its
    deployments' runs may use, read when serve starts: the anchor is the serving process, not the
    deployment's parameters on the server, which the API can PATCH (issue 52)."""
    from flows.serve import allow_code

    for name in (ENV_PATHS, ENV_MODULES, ENV_FIELDS, ENV_ROOTS, ENV_HOSTS, ENV_LIMITS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(project)
    (project / "data").mkdir()
    (project / "data" / "train.jsonl").write_text('{"prompt": "p"}\n')
    own = {
        "storage": {"root": str(project / "served-runs")},
        "data": {"source": str(project / "data" / "train.jsonl")},
        "rewards": [{"function": "char_match"}],
        "train": {"rollout": {"engine": "http", "url": "http://127.0.0.1:30000", "reload_route": "/r"}},
    }
    allow_code([], [], [], own, None, ["Other.Host:8000"], ["train.num_steps=2000000"])
    policy = TrustPolicy.from_env()
    assert policy.roots == (os.path.realpath(project / "served-runs"), os.path.realpath(project / "data/train.jsonl"))
    assert policy.fields == ("train.rollout.url",) and policy.hosts == ("other.host:8000",)
    assert policy.limits == (("train.num_steps", 2e6),)
    policy.check(cfg(*(f"{k}={v}" for k, v in [("storage.root", project / "served-runs")]), "train.num_steps=1500000"))
    with pytest.raises(ConfigError, match=r"^data\.source=.*not where this deployment's runs read"):
        policy.check(cfg(f"data.source={project}/data/other.jsonl"))


def test_places_stay_under_the_allowed_roots(project):
    """issue 28: a run from the UI writes into no other folder or bucket and reads no other file of
    the machine: the default config's places, or under a root the operator allowed (grpo serve adds
    its own config's places); Hub ids, the synthetic task and run names are not places."""
    TrustPolicy().check(cfg("data.source=openai/gsm8k", "model.init_from=nightly-*"))  # a Hub id, a run name
    TrustPolicy().check(cfg("storage.root=runs"), cwd=str(project))  # the default config's
    with pytest.raises(ConfigError, match=r"^storage\.root=.* may not be set in a deployment run: .*--allow-root"):
        TrustPolicy().check(cfg(f"storage.root={project}/.."))
    with pytest.raises(ConfigError, match=r"^data\.source='/etc/passwd\.jsonl' may not .* where this .* runs read"):
        TrustPolicy().check(cfg("data.source=/etc/passwd.jsonl"))
    policy = TrustPolicy()
    assert policy.place_refusal("model.path", "Qwen/Qwen2.5-0.5B") is None  # a Hub id
    for field, value in [
        ("data.eval_source", f"{project}/rewards/mine.py.jsonl"),
        ("model.path", "gs://someone-elses/model"),
        ("model.tokenizer", "./tok"),
        ("model.init_from", "gs://someone-elses/runs/x@4"),
    ]:
        assert "is not where this deployment's runs read" in policy.place_refusal(field, value), field
    assert "runs write" in policy.place_refusal("train.rollout.export_dir", "/any/dir")
    # `..` is resolved before it is compared: runs/../x is not under runs (nor gs://b/runs/../x)
    with pytest.raises(ConfigError, match=r"^storage\.root=.* is not where this deployment's runs write"):
        TrustPolicy.from_env({ENV_ROOTS: f"{project}/runs"}, cwd=str(project)).check(cfg("storage.root=runs/../x"))
    allowed = TrustPolicy.from_env({ENV_ROOTS: f"{project}/shared,gs://someone-elses/runs"}, cwd=str(project))
    assert allowed.place_refusal("model.init_from", "gs://someone-elses/runs/x@4") is None
    assert allowed.place_refusal("storage.root", "gs://someone-elses/runs/../other") is not None
    allowed.check(cfg(f"storage.root={project}/shared/a", f"data.source={project}/shared/q.jsonl"))
    with pytest.raises(ConfigError, match=r"^storage\.root=.*allowed: .*/shared, gs://someone-elses/runs"):
        allowed.check(cfg("storage.root=gs://someone-elses/runs-2"))  # a prefix, not a folder


def test_every_text_field_says_what_it_names():
    """A new field that names a place, a program, a module or an address cannot slip past the
    policy: every field whose value is text (a string, strings, a mapping) declares a trust class
    next to its declaration, and a field whose name reads like a path, a URL or a program is not
    declared SAFE."""
    import typing

    def texty(hint) -> bool:
        args = typing.get_args(hint) or (hint,)
        return any(a in (str, dict, tuple) or typing.get_origin(a) in (tuple, dict) for a in args)

    texts = [d for d in declared() if texty(d.hint) and not typing.get_args(d.hint) == (int, ...)]
    unclassified = [d.path for d in texts if d.trust is None and "prompt_buckets" not in d.path]
    assert unclassified == [], f"declare trust= for {unclassified} (grpo_core.config.fields.Trust)"
    looks_dangerous = re.compile(
        r"(path|dir|root|source|url|address|python|command|server_args|workdir|tokenizer|from)$"
    )
    safe_but_named = [d.path for d in declared() if d.trust is Trust.SAFE and looks_dangerous.search(d.path)]
    assert safe_but_named == [], safe_but_named
    kinds = {d.path: d.trust for d in declared()}
    assert kinds["train.rollout.export_dir"] is Trust.WRITES and kinds["train.rollout.url"] is Trust.ADDRESS
    assert kinds["pipeline.launcher.address"] is Trust.ADDRESS and kinds["rewards[].function"] is Trust.CODE
    assert {d.path for d in declared() if d.api_max} >= {
        "data.synthetic_rows",
        "train.num_steps",
        "pipeline.launcher.num_processes",
        "eval.batch_size",
        "eval.num_samples",
    }


def test_addresses_are_refused_unless_the_host_or_the_field_is_allowed():
    http = cfg(
        "train.rollout.engine=http",
        "train.rollout.url=http://evil.example:30000",
        "train.rollout.reload_route=/update_weights_from_disk",
    )
    with pytest.raises(ConfigError, match=r"^train\.rollout\.url=.* the host evil\.example:30000 is not allowed"):
        TrustPolicy().check(http)
    TrustPolicy.from_env({ENV_HOSTS: "evil.example"}).check(http)
    TrustPolicy.from_env({ENV_HOSTS: "EVIL.example:30000"}).check(http)
    with pytest.raises(ConfigError, match="is not allowed"):
        TrustPolicy.from_env({ENV_HOSTS: "evil.example:1"}).check(http)
    ray = cfg("pipeline.launcher.kind=ray", "pipeline.launcher.address=ray://10.1.2.3:10001")
    with pytest.raises(ConfigError, match=r"^pipeline\.launcher\.address=.*--allow-host"):
        TrustPolicy().check(ray)
    TrustPolicy().check(cfg("pipeline.launcher.kind=ray"))  # address auto: the default
    tpu = cfg("pipeline.launcher.kind=tpu-vm", "pipeline.launcher.tpu_name=someone-elses", "pipeline.launcher.zone=z")
    with pytest.raises(
        ConfigError, match=r"^2 fields .*\(1\) pipeline\.launcher\.tpu_name=.* names a machine.*\(2\) pipel"
    ):
        TrustPolicy().check(tpu)
    TrustPolicy.from_env({ENV_FIELDS: "pipeline.launcher.tpu_name,pipeline.launcher.zone"}).check(tpu)


def test_work_is_bounded_by_limits_the_operator_can_raise():
    for setting, field in [
        ("data.synthetic_rows=1000000000", "data.synthetic_rows"),
        ("train.num_steps=1000000000000", "train.num_steps"),
        ("eval.batch_size=1000000", "eval.batch_size"),
        ("eval.num_samples=1000000", "eval.num_samples"),
        ("pipeline.launcher.num_processes=100000", "pipeline.launcher.num_processes"),
    ]:
        with pytest.raises(ConfigError, match=rf"(^|\) ){re.escape(field)}=.* more than a deployment run may ask for"):
            TrustPolicy().check(cfg(setting))
    TrustPolicy.from_env({ENV_LIMITS: "data.synthetic_rows=2e9"}).check(cfg("data.synthetic_rows=1000000000"))
    TrustPolicy().check(cfg("train.num_steps=auto"))  # a word, not a number
    with pytest.raises(ConfigError, match=f"{ENV_LIMITS} 'model.path=3' must be FIELD=N"):
        TrustPolicy.from_env({ENV_LIMITS: "model.path=3"})


def test_job_variables_may_not_set_the_policy():
    assert refused_job_variables({"env": {"GRPO_ALLOW_ROOTS": "/"}}).startswith(
        "job_variables.env sets GRPO_ALLOW_ROOTS"
    )
    assert refused_job_variables({"env": {"OTHER": "1"}}) is None and refused_job_variables(None) is None


def test_templates_name_columns_only():
    cfg("data.source=x.jsonl", "data.template='Q: {question}\nA:'")
    for bad in ("{question.__class__}", "{question[0]}", "{}"):
        with pytest.raises(ConfigError, match=r"placeholders must be column names like \{question\}"):
            cfg("data.source=x.jsonl", f"data.template='{bad}'")


@pytest.mark.parametrize(
    "setting",
    [
        "data.template='{prompt:>1500000000}'",  # str.format would allocate 1.5 GB before anything refused it
        "data.template='{prompt:{prompt.__class__.__mro__}}'",  # a nested spec: echoes object reprs
        "data.template='{prompt!r}'",
        "run_name='{date:>1000000000}'",
        "run_name='{date.__class__.__init__.__globals__}'",  # was a raw AttributeError
        "run_name='n-{date!s}'",
    ],
)
def test_templates_and_run_names_are_data_refused_when_read(setting):
    """A format spec, a conversion, an attribute or an index is refused when the config is read
    (a ConfigError naming the field), before anything is formatted: nothing is allocated."""
    import tracemalloc

    field = setting.split("=", 1)[0]
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match=rf"^{re.escape(field)} .*no format spec, conversion, attribute or index"):
            cfg("data.source=x.jsonl", setting)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50_000_000, peak  # the spec's gigabyte was never asked for


def test_work_as_a_whole_has_a_total_the_operator_can_raise():
    """Each factor within its own limit, the product over the total: refused naming the product
    and its factors; --raise-limit names the total like a field."""
    big = cfg(
        "train.grpo.prompts_per_step=4096", "train.grpo.num_generations=256", "train.sampling.max_new_tokens=32768"
    )
    with pytest.raises(ConfigError) as err:
        TrustPolicy().check(big)
    msg = str(err.value)
    assert msg.split("(1) ", 1)[-1].startswith(
        "train.tokens_per_step = train.grpo.prompts_per_step 4,096 × train.grpo.num_generations 256 × "
        "(data.max_prompt_tokens 16 + train.sampling.max_new_tokens 32,768) = 34,376,515,584 tokens is more than "
        "a deployment run may ask for (8,388,608)"
    ), msg
    assert "--raise-limit train.tokens_per_step=N" in msg
    TrustPolicy.from_env({ENV_LIMITS: "train.tokens_per_step=4e10,eval.tokens_per_batch=1e7"}).check(big)
    evals = cfg("eval.batch_size=4096", "eval.num_samples=64", "train.sampling.max_new_tokens=1024")
    with pytest.raises(ConfigError, match=r"eval\.tokens_per_batch = eval\.batch_size 4,096 × eval\.num_samples 64"):
        TrustPolicy().check(evals)
    TrustPolicy().check(cfg())  # the demo: 16 × 8 × (16 + 6) tokens a step
    for recipe in ("gsm8k-qwen2.5-0.5b-instruct", "dapo-qwen2.5-math-7b"):  # real recipes fit the totals
        operator = {ENV_FIELDS: "pipeline.report_to", ENV_ROOTS: os.getcwd()}  # the recipes' own files, trackers
        TrustPolicy.from_env(operator).check(load_config(f"recipes/{recipe}.yaml"))


def test_trackers_that_send_are_addresses_and_local_ones_write_under_the_run_root(tmp_path):
    """pipeline.report_to from a deployment: W&B and a remote MLflow send the run's metrics (with
    the operator's key) to an address, refused unless the operator allows the host or the field;
    TensorBoard, W&B offline and MLflow without a tracking URI write under the run root, which
    MLflow then needs to be a local folder."""
    wandb = cfg("pipeline.report_to=[wandb]")
    with pytest.raises(ConfigError) as err:
        TrustPolicy().check(wandb)
    assert str(err.value).startswith(
        "pipeline.report_to=('wandb',) may not be set in a deployment run: the tracker wandb sends the run's "
        "metrics to https://api.wandb.ai: the host api.wandb.ai is not allowed"
    ), err.value
    assert "--allow-field pipeline.report_to" in str(err.value)
    TrustPolicy.from_env({ENV_HOSTS: "api.wandb.ai"}).check(wandb)
    TrustPolicy.from_env({ENV_FIELDS: "pipeline.report_to"}).check(wandb)
    TrustPolicy.from_env({"WANDB_MODE": "offline"}).check(wandb)
    with pytest.raises(ConfigError, match="sends the run's metrics to http://wandb.internal:8080"):
        TrustPolicy.from_env({"WANDB_BASE_URL": "http://wandb.internal:8080"}).check(wandb)
    TrustPolicy().check(cfg("pipeline.report_to=[tensorboard]"))
    mlflow = cfg("pipeline.report_to=[mlflow]", f"storage.root={tmp_path}")
    TrustPolicy.from_env({ENV_ROOTS: str(tmp_path)}).check(mlflow)  # its store: {run}/mlflow.db
    remote = {"MLFLOW_TRACKING_URI": "https://mlflow.example:5000", ENV_ROOTS: str(tmp_path)}
    with pytest.raises(ConfigError, match=r"tracker mlflow sends .* the host mlflow\.example:5000 is not allowed"):
        TrustPolicy.from_env(remote).check(mlflow)
    TrustPolicy.from_env({**remote, ENV_HOSTS: "mlflow.example:5000"}).check(mlflow)
    on_gcs = cfg("pipeline.report_to=[mlflow]", "storage.root=gs://bucket/runs")
    with pytest.raises(ConfigError, match=r"keeps its store in the run root, and gs://bucket/runs.* is not a local"):
        TrustPolicy.from_env({ENV_ROOTS: "gs://bucket/runs", ENV_FIELDS: "pipeline.report_to"}).check(on_gcs)
    assert "MLFLOW_TRACKING_URI" in refused_job_variables({"env": {"MLFLOW_TRACKING_URI": "http://x"}})


def test_reserved_run_names():
    with pytest.raises(ConfigError, match=r"run_name may not start with '_'.*_flow-runs"):
        cfg("run_name=_flow-runs")


def test_grpo_serve_allow_root(project, monkeypatch):
    from flows.serve import allow_code

    monkeypatch.delenv(ENV_ROOTS, raising=False)
    monkeypatch.chdir(project)
    allow_code([], [], [], None, ["shared/runs", "gs://bucket/runs/"])
    assert TrustPolicy.from_env().roots == (os.path.realpath(project / "shared" / "runs"), "gs://bucket/runs")
    with pytest.raises(ValueError, match="may not contain ','"):
        allow_code([], [], [], None, ["a,b"])


def test_a_pickled_reward_is_never_allowed_in_a_deployment_run(project, monkeypatch):
    """A callable pickled by value (flows.notebook's rewards) runs for the local user who pickled it;
    a deployment run refuses it before anything runs, wherever the pickle lies and whatever the
    operator allows: the allowed reward folder, the whole spec as a module, any root."""
    import types

    import flows.pipeline as pipeline
    from grpo_core.rewards.by_value import save_reward

    def shout(prompts, completions, **kw):
        return [1.0] * len(completions)

    spec = save_reward(shout, str(project / "rewards"), "shout")  # inside the folder the operator allows
    assert spec.endswith("shout.pkl:shout") and spec.startswith(str(project / "rewards" / "_inputs" / "rewards"))
    c = cfg(f'rewards=[{{function: "{spec}"}}]')
    assert make_rewards(c.rewards)[0].fn([], ["a", "b"]) == [1.0, 1.0]  # the local user's loader takes it
    env = {ENV_PATHS: str(project), ENV_MODULES: spec, ENV_ROOTS: "/"}
    for policy in (TrustPolicy.from_env({}, cwd=str(project)), TrustPolicy.from_env(env, cwd=str(project))):
        with pytest.raises(ConfigError, match=r"^rewards\[0\]\.function '.*shout\.pkl:shout' may not run in a "):
            policy.check(c, cwd=str(project))
        assert "pickled code" in policy.reward_refusal(spec, cwd=str(project))
    evals = cfg(f'eval.rewards=[{{function: exact_match}}, {{function: "{spec}"}}]', "eval.accuracy_reward=exact_match")
    with pytest.raises(ConfigError, match=r"^eval\.rewards\[1\]\.function .*pickled code"):
        TrustPolicy().check(evals)
    # where the flow calls the policy: a deployment's run (its id set) is refused and not retried;
    # a direct call (the notebook's, the CLI's) is the local user's
    monkeypatch.setattr(pipeline, "_job_variables", lambda log: {"env": {}})
    monkeypatch.setattr(pipeline, "pool_record_refusal", lambda deployment_id: None)  # no server here
    monkeypatch.setattr(pipeline, "_no_flow_retry", lambda log: None)
    monkeypatch.setattr(pipeline, "deployment", types.SimpleNamespace(id=None))
    assert pipeline._allowed(lambda: c, log=None) is c
    monkeypatch.setattr(pipeline, "deployment", types.SimpleNamespace(id="a-deployment"))
    for name in (ENV_PATHS, ENV_MODULES):
        monkeypatch.setenv(name, env[name])
    with pytest.raises(ConfigError, match="a deployment never loads one"):
        pipeline._allowed(lambda: c, log=None)


def test_one_refusal_names_every_refused_field():
    """A deployment run that names several things the operator did not allow is refused once, the
    message naming each field with the setting that would allow it (a user fixes them all at once)."""
    c = cfg(
        "data.source=/etc/x.jsonl", "pipeline.report_to=[wandb]", "rewards=[os:system]", "train.num_steps=100000000"
    )
    with pytest.raises(ConfigError) as err:
        TrustPolicy().check(c)
    msg = str(err.value)
    assert msg.startswith("4 fields may not be set in a deployment run: (1) rewards[0].function 'os:system'")
    for i, (field, setting) in enumerate(
        [
            ("rewards[0].function", "--allow-reward-module"),
            ("data.source", "--allow-root"),
            ("train.num_steps", "--raise-limit train.num_steps"),
            ("pipeline.report_to", "--allow-field pipeline.report_to"),
        ],
        1,
    ):
        part = msg.split(f"({i}) ", 1)[1]
        assert part.startswith(field) and setting in part.split(f"({i + 1}) ", 1)[0], (i, part[:200])
