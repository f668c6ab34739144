"""What a deployment run reads is what its places hold (grpo_core.rewards.trust.check_reads): a
link inside an allowed data, model or run folder is read as its target, so the target must lie
under an allowed root too (issue 61). A local run of the same config is not restricted. Errors
about a row quote a short excerpt of it, never the row (grpo_core.errors.excerpt). Through a real
`grpo serve`: bench/attack_matrix.py's cases."""

import contextlib
import json
import os
import sys
import types

import pytest

import flows.pipeline as pipeline
from grpo_core.config.run import load_config
from grpo_core.data.prepare import EncodeError, dry_run
from grpo_core.data.synthetic import CharTokenizer
from grpo_core.errors import ConfigError, excerpt
from grpo_core.rewards.trust import ENV_ROOTS, TRUST_ENV, TrustPolicy, check_folder, check_reads, link_out

SECRET = "TOPSECRET-" + "s" * 200


def cfg(*sets):
    return load_config(None, list(sets))


@pytest.fixture
def place(tmp_path):
    """runs/ (the operator's root) holding a data folder, a model folder and a run; outside/ the
    machine's files no deployment run may read."""
    runs, outside = tmp_path / "runs", tmp_path / "outside"
    (runs / "dsdir").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.jsonl").write_text(json.dumps({"prompt": SECRET}) + "\n")
    for i in range(3):
        (runs / "dsdir" / f"part-{i + 1}.jsonl").write_text(json.dumps({"prompt": f"abc{i}"}) + "\n")
    (runs / "dsdir" / "part-0.jsonl").symlink_to(outside / "secret.jsonl")
    model = runs / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (outside / "tokenizer.json").write_text('{"secret": "' + SECRET + '"}')
    (model / "tokenizer.json").symlink_to(outside / "tokenizer.json")
    return types.SimpleNamespace(
        base=tmp_path, runs=runs, outside=outside, policy=TrustPolicy.from_env({ENV_ROOTS: str(runs)})
    )


def test_a_link_in_a_data_folder_to_outside_the_roots_is_refused(place):
    """issue 61 item 3: RUNS/dsdir/part-0.jsonl -> /secret.jsonl with data.source=RUNS/dsdir ran three
    tasks and the flow run's state quoted the secret row. The folder's name is allowed, its link is not."""
    c = cfg(f"data.source={place.runs}/dsdir")
    place.policy.check(c)  # the name: under the root
    with pytest.raises(ConfigError) as err:
        check_reads(place.policy, c)
    msg = str(err.value)
    assert msg.startswith(f"data.source='{place.runs}/dsdir' may not be read in a deployment run: ")
    assert f"{place.runs}/dsdir/part-0.jsonl is a link to {place.outside}/secret.jsonl, which is not where" in msg
    assert f"(allowed: {place.runs})" in msg and "grpo serve --allow-root ROOT" in msg and ENV_ROOTS in msg
    assert "TOPSECRET" not in msg
    # the same folder for data.eval_source's file, and a link out as the file itself
    with pytest.raises(ConfigError, match=r"^data\.eval_source=.* is a link to .*outside/secret\.jsonl"):
        check_reads(
            place.policy,
            cfg(f"data.source={place.runs}/dsdir/part-1.jsonl", f"data.eval_source={place.runs}/dsdir/part-0.jsonl"),
        )
    # an operator who allows outside/ too: nothing refused
    both = TrustPolicy.from_env({ENV_ROOTS: f"{place.runs},{place.outside}"})
    check_reads(both, c)


def test_links_inside_the_roots_are_read_and_walked(place):
    """A link whose target is inside is fine; a linked folder inside is walked too (a link out of it
    is found), each folder once (a loop ends); a dangling link out is refused like any other."""
    d = place.runs / "dsdir"
    os.unlink(d / "part-0.jsonl")
    (d / "again.jsonl").symlink_to(d / "part-1.jsonl")
    (d / "loop").symlink_to(d)
    (place.runs / "shared").mkdir()
    (d / "shared").symlink_to(place.runs / "shared")
    assert link_out(str(d), place.policy.roots) is None
    (place.runs / "shared" / "deep").mkdir()
    (place.runs / "shared" / "deep" / "x.jsonl").symlink_to(place.outside / "secret.jsonl")
    assert link_out(str(d), place.policy.roots) == (
        f"{d}/shared/deep/x.jsonl",
        f"{place.outside}/secret.jsonl",
    )
    os.unlink(place.runs / "shared" / "deep" / "x.jsonl")
    (d / "gone.jsonl").symlink_to(place.outside / "not-yet.jsonl")  # dangling: what it may name later
    assert link_out(str(d), place.policy.roots) == (f"{d}/gone.jsonl", f"{place.outside}/not-yet.jsonl")


def test_a_model_folder_with_a_link_out_is_refused(place):
    """model.path and model.tokenizer folders: each file by what it resolves to."""
    with pytest.raises(ConfigError) as err:
        check_reads(place.policy, cfg(f"model.path={place.runs}/model"))
    msg = str(err.value)
    assert msg.startswith(f"model.path='{place.runs}/model' may not be read in a deployment run: ")
    assert f"{place.runs}/model/tokenizer.json is a link to {place.outside}/tokenizer.json" in msg
    with pytest.raises(ConfigError, match=r"^model\.tokenizer=.*/runs/model/tokenizer\.json is a link to .*outside"):
        check_reads(place.policy, cfg(f"model.tokenizer={place.runs}/model"))


def test_init_from_and_the_evaluated_run_folder_are_walked(place):
    """model.init_from's run folder (a run name under storage.root, a pattern's matches, a path) and
    the evaluate deployment's run_url."""
    run = place.runs / "nightly-1"
    (run / "checkpoints" / "4").mkdir(parents=True)
    (run / "checkpoints" / "4" / "state").symlink_to(place.outside / "secret.jsonl")
    for ref in ("nightly-1", "nightly-1@4", "nightly-*", f"{run}@4"):
        c = cfg(f"storage.root={place.runs}", f"model.init_from={ref}")
        place.policy.check(c)
        with pytest.raises(ConfigError, match=r"^model\.init_from=.*nightly-1/checkpoints/4/state is a link to"):
            check_reads(place.policy, c)
    check_reads(place.policy, cfg(f"storage.root={place.runs}", "model.init_from=other-*"))  # no match: nothing read
    with pytest.raises(ConfigError, match=r"^run_url=.* may not be read .*checkpoints/4/state is a link to"):
        check_folder(place.policy, "run_url", str(run), str(run))
    check_folder(place.policy, "run_url", "gs://bucket/runs/x", "gs://bucket/runs/x")  # a URL has no links


def test_a_data_folder_of_thousands_of_files_is_walked_not_read(tmp_path):
    """Names and links only: 5,000 files and 500 links inside, and not one of them opened (a walk of
    25,500 files took 0.03 s here)."""
    d = tmp_path / "big"
    d.mkdir()
    for i in range(5000):
        (d / f"part-{i}.jsonl").write_text("{}\n")
    for i in range(500):
        (d / f"link-{i}.jsonl").symlink_to(d / f"part-{i}.jsonl")
    policy = TrustPolicy.from_env({ENV_ROOTS: str(tmp_path)})
    with _audit_opens(str(d)) as touched:
        check_reads(policy, cfg(f"data.source={d}"))
    assert touched == [str(d)]  # the one folder listed; no file opened


@contextlib.contextmanager
def _audit_opens(under: str):
    """The paths under `under` this process opens or lists in the block. An audit hook cannot be
    removed: once the block ends it returns at once."""
    seen: list[str] = []
    active = [True]

    def hook(event, args):
        if active[0] and event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes)):
            path = os.fsdecode(args[0])
            if os.path.realpath(path).startswith(under + os.sep) or os.path.realpath(path) == under:
                seen.append(path)

    sys.addaudithook(hook)
    try:
        yield seen
    finally:
        active[0] = False


def _flow_run(monkeypatch, params, deployment_id):
    monkeypatch.setattr(pipeline, "deployment", types.SimpleNamespace(id=deployment_id))
    monkeypatch.setattr(pipeline, "flow_run", types.SimpleNamespace(name=None, parameters=params, id=None))
    monkeypatch.setattr(pipeline, "_job_variables", lambda log: {"env": {}})  # the API's answer: none set
    monkeypatch.setattr(pipeline, "pool_record_refusal", lambda deployment_id: None)  # a served one: no pool
    monkeypatch.setattr(pipeline, "_no_flow_retry", lambda log: None)


def test_a_deployment_runs_name_and_flow_read_nothing_the_policy_refuses(place, monkeypatch):
    """issue 61: the flow-run name (the config's versions, the model's config.json, the data's first
    row) was computed before the flow's trust check. In a deployment run the name and the flow's
    check open nothing outside the roots; a local run of the same config reads the link's target."""
    model = place.runs / "model2"
    model.mkdir()
    (place.outside / "config.json").write_text('{"model_type": "TOPSECRET"}')
    (model / "config.json").symlink_to(place.outside / "config.json")
    monkeypatch.chdir(place.base)
    monkeypatch.setenv(ENV_ROOTS, str(place.runs))
    params = {"config": {"model": {"path": str(model)}, "storage": {"root": str(place.runs)}}}
    with _audit_opens(str(place.outside)) as opened:
        _flow_run(monkeypatch, params, "a-deployment")
        assert pipeline._run_named()() == "invalid-config"
        with pytest.raises(
            ConfigError, match=r"^model\.path=.*model2/config\.json is a link to .*outside/config\.json"
        ):
            pipeline._allowed(lambda: pipeline._config(params["config"]), log=None)
        assert opened == []
        # the local user's run of the same config: not refused, and its name reads the link's target
        _flow_run(monkeypatch, params, None)
        pipeline._allowed(lambda: pipeline._config(params["config"]), log=None)
        pipeline._run_named()()
    assert opened and all(os.path.realpath(p) == str(place.outside / "config.json") for p in opened)


def test_a_row_the_tokenizer_cannot_encode_is_quoted_short(tmp_path):
    """The row error names the file, the row, the character and its position, and quotes 40
    characters around it: never the row (issue 61's state message quoted the secret row)."""
    rows = [{"prompt": "abc"}, {"prompt": "abc " + "x" * 300 + "TOP" + "y" * 300}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = cfg(f"data.source={tmp_path}/d.jsonl")
    with pytest.raises(EncodeError) as err:
        dry_run(c.data, CharTokenizer())
    msg = str(err.value)
    assert msg.startswith(f"{tmp_path}/d.jsonl row 1: the tokenizer cannot encode the prompt (model.tokenizer): ")
    assert "character 'T' at position 304 (...'" + "x" * 20 + "TOP" + "y" * 17 + "'...) is not in the alphabet" in msg
    assert "x" * 21 not in msg and "y" * 18 not in msg


def test_an_excerpt_is_short_and_printable():
    assert excerpt("short") == "'short'"
    assert excerpt("a" * 100, 10) == "'aaaaaaaaaa'..."
    assert excerpt("0123456789" * 10, 10, at=50) == "...'5678901234'..."  # position 50 ('0') in the middle
    assert excerpt("ab\x1b[2J\u202ecd" + "z" * 50, 12) == "'ab\\x1b[2J\\u202ecdzzz'..."
    assert excerpt(b"\x00raw") == "b'\\x00raw'"


def test_a_sharded_index_names_files_of_its_folder_only(tmp_path):
    """model.safetensors.index.json's shards are files beside it: a path in a shard's place would
    be read outside the folder the policy walked, as a link would."""
    from grpo_core.nn.hf import _files

    for shard in ("../outside/x.safetensors", "/etc/x.safetensors", ".."):
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
        with pytest.raises(ConfigError, match=r"index\.json: weight_map names the shard .* not a file name in"):
            _files(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "m-1.safetensors"}}))
    assert _files(str(tmp_path)) == [str(tmp_path / "m-1.safetensors")]


def test_a_reward_models_folder_is_a_place_read(place, monkeypatch, tmp_path):
    """issue 64: rewards[].model (and eval.rewards[].model) names a folder a deployment run reads,
    as model.path does: under an allowed root by name, and by what its links resolve to; a Hub id
    is not a place. Its batch size and length are work within their declared limits; grpo serve
    allows its own config's reward model folder."""
    rm = f"{place.runs}/model"
    c = cfg(f"rewards=[{{model: {rm}}}]")
    place.policy.check(c)  # the folder's name: under the root
    with pytest.raises(ConfigError) as err:
        check_reads(place.policy, c)
    msg = str(err.value)
    assert msg.startswith(f"rewards[0].model='{rm}' may not be read in a deployment run: ")
    assert f"{rm}/tokenizer.json is a link to {place.outside}/tokenizer.json" in msg and "TOPSECRET" not in msg
    with pytest.raises(ConfigError, match=r"^eval\.rewards\[1\]\.model='.*outside' may not be set .*--allow-root"):
        place.policy.check(cfg("eval.rewards=[{function: exact_match}, {model: %s}]" % place.outside))
    place.policy.check(cfg("rewards=[{model: OpenAssistant/reward-model-deberta-v3-large-v2}]"))  # a Hub id
    with pytest.raises(ConfigError, match=r"^rewards\[0\]\.model=.*\(no other root is allowed\)"):
        TrustPolicy().check(cfg(f"rewards=[{{model: {place.outside}}}]"))
    with pytest.raises(ConfigError, match=r"^rewards\[0\]\.batch_size=2000 is more than .*rewards\[\]\.batch_size=N"):
        place.policy.check(cfg(f"rewards=[{{model: {rm}, batch_size: 2000}}]"))
    TrustPolicy.from_env({ENV_ROOTS: str(place.runs), "GRPO_LIMITS": "rewards[].batch_size=4096"}).check(
        cfg(f"rewards=[{{model: {rm}, batch_size: 2000}}]")
    )
    from flows.serve import allow_code

    for name in TRUST_ENV:  # set first, so that monkeypatch restores their absence after allow_code sets them
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    os.unlink(place.runs / "model" / "tokenizer.json")
    allow_code([], [], [], {"rewards": [{"model": rm}]})
    served = TrustPolicy.from_env()
    assert os.path.realpath(rm) in served.roots
    check_reads(served, c)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("pipeline", lambda p: {"config": {"storage": {"root": str(p.runs)}, "data": {"source": str(p.secret)}}}),
        (
            "readiness",
            lambda p: {"config": {"storage": {"root": str(p.runs)}, "pipeline": {"worker_python": "/bin/sh"}}},
        ),
        ("train", lambda p: {"storage_root": str(p.runs), "data_source": str(p.secret)}),
        ("check", lambda p: {"storage_root": str(p.runs), "rewards": [{"function": "os:system"}]}),
        ("evaluate", lambda p: {"run_url": str(p.outside)}),
    ],
)
def test_grpo_serve_refuses_before_a_process_what_the_flow_would(name, params, place, monkeypatch):
    """grpo serve checks a flow run's parameters and job variables before it starts the run's
    process (flows.serve.refusal, in flows.serve_runner): the message is the flow's own (its
    _allowed on the same arguments), the everyday form's unset fields take their defaults, an
    allowed run is started (None), and job variables that set the policy are refused."""
    from prefect.utilities.callables import get_call_parameters

    from flows import everyday, serve

    monkeypatch.chdir(place.base)
    for variable in TRUST_ENV:  # the operator's policy: this process's environment, whatever set it before
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv(ENV_ROOTS, str(place.runs))
    p = types.SimpleNamespace(runs=place.runs, outside=place.outside, secret=place.outside / "secret.jsonl")
    given = params(p)
    record = types.SimpleNamespace(job_variables={})
    said = serve.refusal(name, types.SimpleNamespace(parameters=given, job_variables={}), record)
    flow = serve.SERVED_FLOWS[name]
    _flow_run(monkeypatch, given, "a-deployment")
    for module in (pipeline, everyday):  # the flows' logger, outside a flow run
        monkeypatch.setattr(module, "get_run_logger", lambda: None)
    monkeypatch.setattr(pipeline, "_refusal", lambda exc, log: exc)  # the flow's ConfigError itself
    with pytest.raises(ConfigError) as flows_own:
        flow.fn(**get_call_parameters(flow.fn, (), flow.validate_parameters(given)))  # as Prefect's engine calls it
    assert said == str(flows_own.value) and SECRET not in said
    allowed = {"evaluate": {"run_url": str(place.runs / "r")}}.get(name, {})
    run = types.SimpleNamespace(parameters=allowed, job_variables={})
    if name == "evaluate":  # its run folder is allowed; that it holds no run is the flow's to say, as ever
        assert serve.refusal(name, run, record).endswith(
            "does not exist: start the run with grpo_pipeline, which writes it first"
        )
    else:
        assert serve.refusal(name, run, record) is None
    run.job_variables = {"env": {ENV_ROOTS: "/"}}
    assert serve.refusal(name, run, record).startswith("job_variables.env sets GRPO_ALLOW_ROOTS")
