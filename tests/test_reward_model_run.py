"""A run whose reward is a model (issue 64): `grpo tiny-model`'s policy and its tiny random Qwen2
reward model (`grpo tiny-model --reward-model`), chat prompts from a JSONL file, from the CLI and
from flows.notebook.train. The metrics carry rewards/<name>/mean and /std (TRL's names) with a
std above 0 (the model scores completions differently), each evaluation its mean, and
eval/<step>.json's examples each example's score by every evaluation reward."""

import json
import math

import pytest

from grpo_core.nn.tiny_hf import write_tiny_model
from grpo_core.store.root import RunRoot

pytestmark = pytest.mark.usefixtures("prefect_server")

WORDS = ["cat", "dog", "sun", "sky", "tree", "moon", "fish", "bird"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("rm-run")
    policy = write_tiny_model(base / "tiny-qwen")
    rm = write_tiny_model(base / "tiny-rm", arch="qwen2", reward_model=True, seed=3)
    data = base / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say a word like {w}", "answer": w}) + "\n" for w in WORDS))
    return policy, rm, data


SETTINGS = {
    "data.chat": True,
    "data.max_prompt_tokens": 64,
    "data.eval_fraction": 0.25,
    "train.num_steps": 2,
    "train.grpo.prompts_per_step": 2,
    "train.grpo.num_generations": 4,
    "train.sampling.max_new_tokens": 8,
    "eval.num_samples": 1,
    "eval.batch_size": 2,
    "pipeline.epochs": 1,
    "pipeline.retries": 0,
    "pipeline.flow_retries": 0,
}


def _check_run(url: str) -> None:
    root = RunRoot(url)
    rows = root.read_metrics()
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["rewards/tiny-rm/std"] > 0 and math.isfinite(r["rewards/tiny-rm/mean"])
        assert r["reward"] == pytest.approx(r["rewards/tiny-rm/mean"])  # weight 1, the only reward
    for step in (0, 2):
        result = root.read_json(f"eval/{step}.json")
        assert math.isfinite(result["greedy"]["tiny-rm"]) and result["accuracy"] == result["greedy"]["tiny-rm"]
        examples = result["examples"]
        assert examples and all(isinstance(e["rewards"]["tiny-rm"], float) for e in examples)


@pytest.mark.slow  # a whole run (~30 s with its setup): make test runs it, the edit loop does not
def test_a_reward_model_run_from_the_cli(folders, tmp_path):
    from flows.cli import main

    policy, rm, data = folders
    sets = [f"{k}={json.dumps(v)}" for k, v in SETTINGS.items()]
    code = main(
        [
            "run",
            "--set",
            f"storage.root={tmp_path}/runs",
            "--set",
            "run_name=rm-cli",
            "--set",
            f"model.path={policy}",
            "--set",
            f"data.source={data}",
            "--set",
            f"rewards=[{{model: {rm}}}]",
            *(a for s in sets for a in ("--set", s)),
        ]
    )
    assert code == 0
    _check_run(f"{tmp_path}/runs/rm-cli")


@pytest.mark.slow  # a second run (~30 s), through the notebook's entry point
def test_a_reward_model_run_from_a_notebook(folders, tmp_path):
    from flows.notebook import train

    policy, rm, data = folders
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    run = train(
        data=rows,
        rewards=[{"model": str(rm), "weight": 1.0}],
        model=str(policy),
        run_name="rm-notebook",
        progress=False,
        **{"storage.root": str(tmp_path / "runs")},
        **SETTINGS,
    )
    assert run.summary["status"] == "completed"
    _check_run(run.url)


@pytest.mark.slow  # a grpo serve and a run through its pipeline deployment (~60 s)
def test_a_reward_model_run_from_the_pipeline_deployment(folders, server, tmp_path):
    """The same run from the API, as the UI's Run would start it: `grpo serve` allowing the folder
    the policy, the reward model and the data lie in (a reward model's folder is a place read)."""
    from tests.prefect_server import BIN, _stop, api_client, client_env
    from tests.test_deployments import _wait
    from tests.test_serve_ownership import registered
    from tests.test_serve_record import start

    url, home = server
    policy, rm, data = folders
    log = tmp_path / "serve.log"
    allow = ["--allow-root", str(policy.parent), "--allow-root", str(tmp_path)]
    proc = start([f"{BIN}/grpo", "serve", "--limit", "1", *allow], client_env(home, url), log)
    try:
        with api_client(url) as client:
            registered(client, proc, log)
            dep = client.read_deployment_by_name("grpo-pipeline/pipeline")
            config = {"storage": {"root": str(tmp_path / "runs")}, "run_name": "rm-deployment"}
            config |= {"model": {"path": str(policy)}, "data": {"source": str(data)}, "rewards": [{"model": str(rm)}]}
            for dotted, value in SETTINGS.items():
                section, key = dotted.split(".", 1)
                node = config.setdefault(section, {})
                *inner, last = key.split(".")
                for k in inner:
                    node = node.setdefault(k, {})
                node[last] = value
            run = client.create_flow_run_from_deployment(dep.id, parameters={"config": config})
            run = _wait(client, run.id, timeout=600)
            assert run.state.is_completed(), (run.state.message, log.read_text()[-3000:])
    finally:
        _stop(proc)
    _check_run(f"{tmp_path}/runs/rm-deployment")
