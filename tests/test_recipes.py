"""Defaults by task (issue 29, item 1): the synthetic task keeps its tuned recipe (and hashes);
a run on the user's data or a real model gets TRL's and verl's defaults, each with its source;
fields the user sets are kept; `grpo check` says which recipe filled which fields and why."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from flows.cli import main
from grpo_core.config.recipes import HF_DEFAULTS, choose, explain
from grpo_core.config.run import DEFAULT, RunConfig, load_config
from grpo_core.errors import ConfigError
from grpo_core.resolve import resolve_run

# The issue's command: 64 GSM8K rows as JSONL, math_answer, the qwen2.5-0.5b preset.
ISSUE = ["data.source=gsm8k.jsonl", "rewards=[{function: math_answer}]", "model.preset=qwen2.5-0.5b"]


def resolved(cfg: RunConfig) -> dict:
    t = cfg.train
    return {
        "max_new_tokens": t.sampling.max_new_tokens,
        "learning_rate": t.optimizer.learning_rate,
        "warmup_steps": t.optimizer.warmup_steps,
        "entropy_coef": t.grpo.entropy_coef,
        "dynamic_sampling": t.grpo.dynamic_sampling,
        "epsilon_high": t.grpo.epsilon_high,
        "beta": t.grpo.beta,
        "loss_aggregation": t.grpo.loss_aggregation.value,
        "num_generations": t.grpo.num_generations,
        "prompts_per_step": t.grpo.prompts_per_step,
        "max_prompt_tokens": cfg.data.max_prompt_tokens,
    }


def test_the_issues_command_gets_trl_and_verl_defaults():
    got = resolved(load_config(None, ISSUE))
    assert got == {
        "max_new_tokens": 256,  # was 6: no GSM8K answer fits
        "learning_rate": 1e-6,  # was 5e-4, ~500x TRL's and verl's
        "warmup_steps": 0,
        "entropy_coef": 0.0,  # the demo's bonus (0.03) is demo-only
        "dynamic_sampling": False,
        "epsilon_high": 0.2,
        "beta": 0.0,
        "loss_aggregation": "token_mean",
        "num_generations": 8,
        "prompts_per_step": 8,
        "max_prompt_tokens": 512,
    }


@pytest.mark.parametrize(
    ("sets", "recipe", "why"),
    [
        ([], "synthetic", "the synthetic task on a test preset"),
        (["model.preset=small", "model.lora.rank=4"], "synthetic", "the synthetic task on a test preset"),
        (["data.source=x.jsonl"], "hf", "data.source is set"),
        (["model.path=/models/qwen"], "hf", "model.path is set"),
        (["model.preset=llama-3.2-1b"], "hf", "model.preset llama-3.2-1b is a real model's shape"),
    ],
)
def test_which_recipe_and_why(sets, recipe, why):
    from grpo_core.config.run import read_config

    got = choose(read_config(None, sets))
    assert got.name == recipe and got.why.startswith(why)


def test_the_synthetic_task_keeps_its_recipe():
    """The demo's tuned recipe, on the tiny and small presets (with LoRA too), field for field."""
    for sets in ([], ["model.preset=small", "model.lora.rank=4"]):
        train = load_config(None, sets).train
        assert train.num_steps == 600 and train.sampling.max_new_tokens == 6
        assert train.optimizer.learning_rate == 5e-4 and train.grpo.entropy_coef == 0.03
        assert train.grpo.dynamic_sampling and train.grpo.epsilon_high == 0.28


def test_a_real_preset_on_the_synthetic_task_and_lora_get_the_hf_recipe():
    cfg = load_config(None, ["model.preset=qwen3-0.6b"])
    assert cfg.data.source == "synthetic" and cfg.data.max_prompt_tokens == 16  # the task's own data defaults
    assert resolved(cfg)["learning_rate"] == 1e-6 and resolved(cfg)["max_new_tokens"] == 256
    lora = load_config(None, [*ISSUE, "model.lora.rank=16"])
    assert lora.train.optimizer.learning_rate == 1e-5  # ~10x full fine-tuning's


def test_fields_the_user_sets_are_kept():
    sets = [*ISSUE, "train.optimizer.learning_rate=3e-6", "train.grpo.dynamic_sampling=true", "train.num_steps=50"]
    cfg = load_config(None, sets)
    assert cfg.train.optimizer.learning_rate == 3e-6 and cfg.train.grpo.dynamic_sampling
    assert cfg.train.num_steps == 50 and cfg.train.sampling.max_new_tokens == 256
    from grpo_core.config.run import read_config

    filled = explain(read_config(None, sets), DEFAULT)["filled"]
    assert "train.optimizer.learning_rate" not in filled and "train.num_steps" not in filled
    assert filled["train.sampling.max_new_tokens"] == {"value": 256, "source": "TRL GRPOConfig.max_completion_length"}


def test_every_hf_default_names_its_source_and_is_a_real_field():
    cfg = load_config(None, ISSUE).to_dict()
    for d in HF_DEFAULTS:
        assert d.source, d.field
        node = cfg
        for part in d.field.split("."):
            node = node[part]
        assert node == d.value, d.field  # the resolved config holds it: no typo in a path


def test_check_prints_which_recipe_filled_what(tmp_path, capsys):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"what is {i}+1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(20))
    )
    sets = ["--set", f"storage.root={tmp_path}", "--set", f"data.source={data}", "--set", "rewards=[math_answer]"]
    sets += ["--set", "train.optimizer.learning_rate=2e-6"]
    assert main(["check", *sets]) == 0
    out = capsys.readouterr().out
    assert "defaults: the 'hf' recipe (data.source is set) filled the fields not set:" in out
    assert "train.sampling.max_new_tokens      256          TRL GRPOConfig.max_completion_length" in out
    assert "train.optimizer.learning_rate" not in out  # set by the user
    # train.num_steps: auto, 3 epochs over the 18 training rows (2 held out), 8 prompts a step
    assert "train.num_steps 7 x 8 prompts (3.11 epochs over them)" in out
    assert "train.num_steps                    7            auto: TRL" in out
    assert main(["check", "--json", "--set", f"storage.root={tmp_path}"]) == 0
    recipe = json.loads(capsys.readouterr().out)["recipe"]
    assert recipe["recipe"] == "synthetic" and recipe["filled"]["train.optimizer.learning_rate"]["value"] == 5e-4


def test_num_steps_auto_is_epochs_over_the_prepared_rows(tmp_path, monkeypatch):
    """Resolved with the sources' versions, before the run is named: the number is in the config
    (and its hash), counted once per data hash; a new file is a new count."""
    monkeypatch.setenv("GRPO_MODEL_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "rows.jsonl"
    rows = lambda n: "".join(json.dumps({"prompt": f"{i} + 1 =", "answer": str(i + 1)}) + "\n" for i in range(n))
    data.write_text(rows(44))  # 40 train + 4 held out (eval_fraction 0.1)
    sets = [f"data.source={data}", f"storage.root={tmp_path}", "rewards=[math_answer]"]
    cfg = load_config(None, sets)
    assert cfg.train.num_steps == "auto" and cfg.train.num_epochs == 3.0
    ready = resolve_run(cfg)
    assert ready.train.num_steps == 15  # ceil(3 x 40 / 8)
    assert ready.epoch_end(3) == 15 and ready.to_dict()["train"]["num_steps"] == 15
    assert len(list((tmp_path / "cache" / "rows").iterdir())) == 1
    assert resolve_run(load_config(None, [*sets, "train.num_epochs=1"])).train.num_steps == 5
    assert resolve_run(load_config(None, [*sets, "train.num_steps=9"])).train.num_steps == 9  # the user's
    data.write_text(rows(88))  # rewritten in place: a new version, a new count
    assert resolve_run(load_config(None, sets)).train.num_steps == 30  # ceil(3 x 80 / 8)
    # a run's config.json holds the number: its workers never see auto
    back = RunConfig.from_dict(ready.to_dict())
    assert back.train.num_steps == 15 and back.train_hash == ready.train_hash
    with pytest.raises(Exception, match="train.num_steps is auto"):
        cfg.epoch_end(0)


# -- the named recipes in recipes/ (issue 29, item 2) -------------------------------------------

ROOT = pathlib.Path(__file__).resolve().parent.parent
RECIPES = sorted(p.name for p in (ROOT / "recipes").glob("*.yaml"))
# Qwen2.5-Math-7B's config.json (the Hub's), for its shapes: the Hub is not reachable here
MATH_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 152064,
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
# The recipes' Hub datasets, as local files of the same shape (GSM8K rows, verl rows)
LOCAL_DATA = {
    "gsm8k": [
        "data.source={d}/train.jsonl",
        "data.subset=null",
        "data.eval_split=null",
        "data.eval_source={d}/test.jsonl",
    ],
    "dapo": ["data.source={d}/dapo.jsonl", "data.eval_source={d}/aime.jsonl"],
}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A Hub cache (as huggingface_hub lays it out) holding each recipe's model as config.json with
    the real model's shapes and a small BPE tokenizer with a chat template; GSM8K- and verl-shaped
    data files."""
    from grpo_core.config.model import hf_config
    from grpo_core.config.presets import get_preset
    from tests.hf_models import save_bpe_tokenizer

    root = tmp_path_factory.mktemp("recipes")
    models = {
        "Qwen/Qwen2.5-0.5B-Instruct": hf_config(get_preset("qwen2.5-0.5b")),
        "Qwen/Qwen2.5-1.5B-Instruct": hf_config(get_preset("qwen2.5-1.5b")),
        "Qwen/Qwen2.5-Math-7B": MATH_7B,
    }
    for repo, config in models.items():
        entry = root / "hub" / f"models--{repo.replace('/', '--')}"
        (entry / "refs").mkdir(parents=True)
        (entry / "refs" / "main").write_text("2" * 40)
        snap = entry / "snapshots" / ("2" * 40)
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps(config))
        save_bpe_tokenizer(snap)
    gsm = [
        {
            "question": f"Natalia sold {i} clips in April and half as many in May. How many?",
            "answer": f"#### {i + i // 2}",
        }
        for i in range(2, 42, 2)
    ]
    verl = [
        {"prompt": [{"role": "user", "content": f"Find {i}+{i}."}], "reward_model": {"ground_truth": str(2 * i)}}
        for i in range(20)
    ]
    for name, rows in (("train", gsm), ("test", gsm[:6]), ("dapo", verl), ("aime", verl[:5])):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


RESOLVE_AND_CHECK = """
import json, sys
from flows.cli import main
from grpo_core.config.run import load_config
from grpo_core.resolve import resolve_run
recipe, sets = sys.argv[1], sys.argv[2:]
cfg = resolve_run(load_config(recipe, sets))
print(json.dumps({"config": cfg.to_dict()}))
main(["check", "--json", "--config", recipe, *[a for s in sets for a in ("--set", s)]])
"""


def resolve_and_check(hub, recipe: str, *sets: str) -> tuple[dict, dict]:
    """(the resolved config, the `grpo check --json` report) of a recipe, in a process whose Hub
    is the fixture's cache, offline."""
    local = LOCAL_DATA["dapo" if recipe.startswith("dapo") else "gsm8k"]
    sets = (*[s.format(d=hub) for s in local], f"storage.root={hub}/runs", *sets)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub / "hub"), GRPO_MODEL_CACHE=str(hub / "cache"))
    proc = subprocess.run(
        [sys.executable, "-c", RESOLVE_AND_CHECK, str(ROOT / "recipes" / recipe), *sets],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    assert lines, proc.stderr[-3000:]
    first = proc.stdout.index(lines[0])
    config = json.loads(lines[0])["config"]
    return config, json.loads(proc.stdout[first + len(lines[0]) :])


def _leaves(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict) and k not in ("params",):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_resolves_and_passes_its_check(recipe, hub):
    """Every file in recipes/ loads, resolves (its model's shapes from config.json, its tokenizer,
    its data tokenized, train.num_steps counted) with every value it writes kept, passes `grpo
    check` (the memory plan aside where this host is too small: a 7B run), and says what it
    should reach and where that figure was published."""
    import yaml

    text = (ROOT / "recipes" / recipe).read_text()
    assert "What it should reach:" in text and "%" in text and ("verl" in text or "paper" in text)
    assert "grpo check --config recipes/" + recipe in text
    written = yaml.safe_load(text)
    # the v5e recipe's compile for its chip is the slow test below
    sets = ["pipeline.readiness.target=null"] if "readiness" in written.get("pipeline", {}) else []
    config, report = resolve_and_check(hub, recipe, *sets)
    local = {s.split("=")[0] for s in LOCAL_DATA["dapo" if recipe.startswith("dapo") else "gsm8k"]} | {
        "pipeline.readiness.target"
    }
    for field, value in _leaves(written):
        if field in local or (field == "train.num_steps" and value == "auto"):
            continue
        got = config
        for part in field.split("."):
            got = got[part]
        if field == "rewards":
            got = [{k: v for k, v in r.items() if v is not None} for r in got]
            value = [dict({"weight": 1.0}, **r) for r in value]
        assert got == value, field
    assert isinstance(config["train"]["num_steps"], int)  # auto counted from the data
    assert report["recipe"]["recipe"] == "hf"
    failed = {c["name"]: c["detail"] for c in report["checks"] if not c["ok"]}
    if recipe.startswith("dapo"):  # 7B with 8k-token completions: a TPU slice, not this host
        assert set(failed) <= {"memory"}, failed
    else:
        assert not failed and report["ready"], failed


@pytest.mark.slow
def test_the_v5e_lora_recipe_fits_its_chip_as_xla_compiles_it(hub):
    """The recipe that names its target (pipeline.readiness.target: v5e:1x1): every program
    compiled for one v5e chip by XLA's TPU compiler, from this CPU host, within its HBM. ~3.5
    CPU-min of compiling (~2 min alone on 2 cores, 3-4 min beside the rest of the suite). At this
    real shape (Qwen's vocabulary, 1.5B) the plan's choice at auto is the compiler's: the first
    update that fits, the cheaper ones compiled and refused with XLA's figure."""
    pytest.importorskip("libtpu")
    # on 2 cores busy with other work the compile can pass pipeline.check_timeout_s's 600 s default
    _, report = resolve_and_check(hub, "gsm8k-qwen2.5-1.5b-instruct-lora-v5e.yaml", "pipeline.check_timeout_s=2400")
    assert report["ready"], [c for c in report["checks"] if not c["ok"]]
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ready"] and checks["memory"]["ok"] and checks["target"]["ok"], checks
    assert "XLA on v5e:1x1" in checks["memory"]["detail"] and "(chosen by the compiler)" in checks["memory"]["detail"]
    target = report["target"]
    assert sorted(p["program"] for p in target["programs"]) == [
        "decode",
        "eval_decode",
        "eval_prefill",
        "prefill",
        "update",
    ]
    assert all(p["compiled"] and p["fits"] and p["peak_bytes"] <= 0.95 * 16 * 2**30 for p in target["programs"])
    tried = target["update_candidates"]  # stopped at the first that fits
    assert len(tried) >= 2 and tried[-1]["fits"] and not any(c["fits"] for c in tried[:-1]), tried
    assert all(c["peak_bytes"] > 0.95 * 16 * 2**30 for c in tried[:-1])  # refused with XLA's figure


# -- rewards that fit the data (issue 53, item 1) -------------------------------------------------


def _jsonl(path: pathlib.Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def gsm8k_file(path: pathlib.Path, n: int = 20) -> str:
    """GSM8K's shape: a question and a worked solution ending in '#### <number>'."""
    return _jsonl(
        path, [{"question": f"what is {i}+1?", "answer": f"{i} plus 1 is {i + 1}.\n#### {i + 1}"} for i in range(n)]
    )


def rewards_of(cfg: RunConfig) -> list[tuple[str, float]]:
    return [(r.function, r.weight) for r in cfg.rewards]


def test_gsm8k_data_without_rewards_is_scored_by_math_answer(tmp_path):
    """Measured before: GSM8K with no `rewards` trained on char_match (1) and exact_match (0), the
    synthetic task's, against the whole worked solution, and reported exact_match as accuracy."""
    data = gsm8k_file(tmp_path / "train.jsonl")
    test = gsm8k_file(tmp_path / "test.jsonl", 6)
    sets = [f"storage.root={tmp_path}", f"data.source={data}", f"data.eval_source={test}"]
    cfg = load_config(None, sets)
    assert cfg.rewards_default.pending  # data.format auto: the first row decides
    ready = resolve_run(cfg)
    assert rewards_of(ready) == [("math_answer", 1.0)] and not ready.rewards_default.pending
    assert (
        ready.rewards_default.why
        == "data.source reads as gsm8k: ground_truth from its gsm8k rows, the reference answer"
    )
    assert ready.eval.accuracy_reward == "math_answer" and ready.eval_rewards == ready.rewards
    # config.json holds them: the workers, the flow's parameters and a resumed run read them back
    back = RunConfig.from_dict(ready.to_dict())
    assert rewards_of(back) == rewards_of(ready) and back.rewards_default is None
    assert back.train_hash == ready.train_hash and back.eval_hash == ready.eval_hash


@pytest.mark.parametrize(
    ("data", "why"),
    [
        ({"format": "gsm8k"}, "data.format gsm8k: a reference answer in every row (the number after '####')"),
        ({"format": "verl"}, "data.format verl: a reference answer in every row (reward_model.ground_truth)"),
        ({"rename": {"solution": "ground_truth"}}, "data.rename maps 'solution' to ground_truth, the reference answer"),
    ],
)
def test_a_format_or_rename_that_names_the_reference_decides_without_reading(data, why):
    cfg = RunConfig.from_dict({"data": {"source": "/nowhere/rows.jsonl", **data}})
    assert rewards_of(cfg) == [("math_answer", 1.0)] and cfg.rewards_default.why == why
    assert not cfg.rewards_default.pending and cfg.eval.accuracy_reward == "math_answer"


def test_the_format_reward_comes_with_a_prompt_that_asks_for_its_tags():
    ask = "Think inside <think></think>, then give only the final number inside <answer></answer>."
    cfg = RunConfig.from_dict({"data": {"source": "/d/g.jsonl", "format": "gsm8k", "system_prompt": ask}})
    assert rewards_of(cfg) == [("math_answer", 1.0), ("think_format", 0.2)]  # recipes/gsm8k-*.yaml's weights
    assert cfg.eval.accuracy_reward == "math_answer"
    assert cfg.rewards_default.describe() == ["math_answer", "think_format (weight 0.2)"]


def test_prompt_only_data_without_rewards_is_refused_naming_rewards(tmp_path, capsys):
    prompts = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"write a haiku about {i}"} for i in range(12)])
    sets = [f"storage.root={tmp_path}", f"data.source={prompts}"]
    with pytest.raises(ConfigError, match=r"^rewards: none set, and data.source .* \(read as plain; columns: prompt\)"):
        resolve_run(load_config(None, sets))
    assert main(["check", *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: rewards: none set") and "think_format" in err and "integer_answer" in err
    assert not (tmp_path / "runs").exists()
    # the user's rewards always win: on prompt-only data, and over a reference too
    own = resolve_run(load_config(None, [*sets, "rewards=[integer_answer]"]))
    assert rewards_of(own) == [("integer_answer", 1.0)] and own.rewards_default is None
    gsm = resolve_run(load_config(None, [f"data.source={gsm8k_file(tmp_path / 'g.jsonl')}", "rewards=[exact_match]"]))
    assert rewards_of(gsm) == [("exact_match", 1.0)] and gsm.eval.accuracy_reward == "exact_match"


def test_an_answer_column_is_the_reference_once_renamed(tmp_path):
    rows = _jsonl(tmp_path / "qa.jsonl", [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(12)])
    with pytest.raises(ConfigError, match=r"its 'answer' column: data.rename=\{answer: ground_truth\} for math_answer"):
        resolve_run(load_config(None, [f"data.source={rows}"]))
    cfg = resolve_run(load_config(None, [f"data.source={rows}", "data.rename={answer: ground_truth}"]))
    assert rewards_of(cfg) == [("math_answer", 1.0)]


def test_check_lists_the_rewards_and_why(tmp_path, capsys):
    data = gsm8k_file(tmp_path / "gsm8k.jsonl")
    assert main(["check", "--set", f"storage.root={tmp_path}", "--set", f"data.source={data}"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("rewards "))
    assert "['math_answer']" in line and "data.source reads as gsm8k: ground_truth from its gsm8k rows" in line
    assert "eval.accuracy_reward               'math_answer' the first reward with a weight above 0" in out
    # the synthetic task's, said as such (its config and hashes are as they were: test_run_config pins them)
    assert main(["check", "--json", "--set", f"storage.root={tmp_path}"]) == 0
    filled = json.loads(capsys.readouterr().out)["recipe"]["filled"]
    assert filled["rewards"]["value"] == ["char_match", "exact_match (weight 0)"]
    assert filled["rewards"]["source"] == "the synthetic task's rewards (grpo_core/config/run.py DEFAULT)"
    assert filled["eval.accuracy_reward"]["value"] == "exact_match"
    assert rewards_of(load_config(None, [])) == [("char_match", 1.0), ("exact_match", 0.0)]
