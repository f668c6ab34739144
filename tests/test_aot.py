"""Readiness that asks the compiler (grpo_core.rl.aot, grpo_core.stages.aot, grpo check --target):
the run's programs compiled by XLA's real TPU compiler (libtpu, installed by the dev install) for
TPU topologies that are not here, XLA's memory figures against each chip's HBM, a program that
cannot fit refused with XLA's number, and a second check read back from the cache.

No TPU is touched: JAX runs on the CPU and libtpu loads as a compiler only (ALLOW_MULTIPLE_LIBTPU_LOAD:
no /tmp/libtpu_lockfile)."""

import json
import os
import subprocess
import sys
import time

import pytest

from grpo_core.config.presets import get_preset
from grpo_core.config.target import Target
from grpo_core.config.train import GRPOConfig, RematPolicy, SamplingConfig, TrainConfig
from grpo_core.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30


@pytest.fixture(scope="module")
def aot():
    """grpo_core.rl.aot with libtpu loaded as a compiler only (set before libtpu first loads)."""
    os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    from grpo_core.rl import aot

    return aot


def _train(**kw) -> TrainConfig:
    grpo = dict(num_generations=4, prompts_per_step=4, beta=0.04)
    grpo.update(kw.pop("grpo", {}))
    return TrainConfig(grpo=GRPOConfig(**grpo), sampling=SamplingConfig(max_new_tokens=kw.pop("new_tokens", 16)), **kw)


def test_target_names_and_refusals():
    t = Target.parse("v5e:2x4", 2)
    assert (t.generation, t.shape, t.chips, t.hbm_bytes, t.device_kind) == ("v5e", (2, 4), 16, 16 * GiB, "TPU v5 lite")
    assert Target.parse("v4:2x2x1").hbm_bytes == 32 * GiB and Target.parse("v6e:2x2").device_kind == "TPU v6 lite"
    with pytest.raises(ConfigError, match=r"pipeline.readiness.target.*'v5e-8' is a Cloud accelerator type.*v5e:2x4"):
        Target.parse("v5e-8")
    with pytest.raises(ConfigError, match="unknown TPU generation 'v9'"):
        Target.parse("v9:2x2")
    from grpo_core.config.run import load_config

    with pytest.raises(ConfigError, match="pipeline.readiness.target must look like"):
        load_config(None, ["pipeline.readiness.target=v5litepod-4"])
    assert load_config(None, ["pipeline.readiness.target=v6e:2x2"]).pipeline.readiness.target == "v6e:2x2"


@pytest.mark.parametrize(("topology", "kind"), [("v4:2x2x1", "TPU v4"), ("v6e:2x2", "TPU v6 lite")])
def test_tiny_update_compiles_for_each_topology(aot, topology, kind):
    """The update (accumulation inside) for 4 chips of each generation: XLA's figures per chip."""
    devices = aot.topology_devices(Target.parse(topology))
    assert len(devices) == 4 and {d.device_kind for d in devices} == {kind}  # one device per chip (megacore on v4)
    run = aot.RunPrograms(get_preset("tiny"), _train(grpo={"grad_accum_steps": 2}), 16, devices)
    assert run.placement.describe() == "train data=1xfsdp=4xtensor=1"
    compile_, extra = run.update(RematPolicy.FULL, 2)
    r = aot.analyse("update", compile_, sum(run.resident()[k] for k in extra), Target.parse(topology).hbm_bytes)
    assert r["compiled"] and r["fits"], r
    # the state is split over 4 chips: each holds a quarter of params + Adam's two moments, donated in place
    assert r["argument_bytes"] < get_preset("tiny").num_params() * 4 * 3 / 2
    assert r["alias_bytes"] > 0 and r["temp_bytes"] > 0 and r["flops"] > 0
    assert r["peak_bytes"] == r["xla_peak_bytes"] + r["resident_bytes"] > r["argument_bytes"]


@pytest.mark.slow  # two TPU compiles of the update (~36 s in make test-fast's budget): make test runs it
def test_more_chips_hold_less_of_the_updates_activations(aot):
    """The tokens' hidden states are laid out over the learner's rows (CausalLM.hidden_states_grouped):
    16 chips hold less of the update's temporaries than 4. Left to XLA's sharding propagation they
    held more (176 against 96 MiB here; 0.5B at 8 x 8 x 512 held 19.3 GiB a chip on 4 chips and
    17.7 on 8, where the layout puts 7.6 on 4)."""
    train = TrainConfig(
        grpo=GRPOConfig(num_generations=8, prompts_per_step=8, beta=0.04), sampling=SamplingConfig(max_new_tokens=128)
    )
    temp = {}
    for topology in ("v5p:2x2x1", "v5p:2x2x4"):
        target = Target.parse(topology)
        run = aot.RunPrograms(get_preset("tiny"), train, 64, aot.topology_devices(target))
        compile_, _ = run.update(RematPolicy.DOTS, 1)
        temp[target.chips] = aot.analyse("update", compile_, 0, target.hbm_bytes)["temp_bytes"]
    assert temp[16] < 0.8 * temp[4], temp


def test_a_tpu_update_splits_qwens_vocabulary_without_padding_the_head(aot):
    """Qwen's 151,936 words over 16,384 tokens a micro-batch: the CPU's program pads the head to
    149 chunks (a copy of it and of its gradient every call); the TPU's takes 128 unpadded ones
    (grpo_core.config.chunks). Lowered only: the count is fixed before XLA sees the program."""
    import jax

    mc = get_preset("tiny", vocab_size=151936, tie_word_embeddings=False)
    train = _train(grpo={"grad_accum_steps": 1}, new_tokens=1024)
    text = {}
    for name, devices in (("tpu", aot.topology_devices(Target.parse("v5e:2x2"))), ("cpu", jax.devices()[:1])):
        compile_, _ = aot.RunPrograms(mc, train, 16, devices).update(RematPolicy.FULL, 1)
        text[name] = compile_().as_text()
    head_pads = lambda t: [line for line in t.splitlines() if "stablehlo.pad" in line and "151936" in line]
    assert head_pads(text["cpu"]) and not head_pads(text["tpu"])
    assert "1187x" in text["tpu"] and "1020x" in text["cpu"]  # the chunks' widths: 151936 / 128, ceil(/ 149)


def test_a_config_that_cannot_fit_one_v5e_chip_is_refused_with_xlas_number(aot):
    """2 B parameters (a 1 M-word vocabulary) in f32 with Adam on one 16 GiB chip: XLA refuses the
    update at compile time; the report names the program, XLA's figure and says what would fit."""
    mc = get_preset(
        "tiny",
        vocab_size=1_000_000,
        hidden_size=1024,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=2048,
        tie_word_embeddings=False,
    )
    train = _train(grpo={"beta": 0.0, "grad_accum_steps": 1}, remat="full")
    report = aot.check(mc, train, 16, Target.parse("v5e:1x1"), only=(), max_extra=1)
    update = report["programs"][0]
    assert update["program"] == "update" and not update["compiled"] and not update["fits"]
    assert "RESOURCE_EXHAUSTED" in update["error"] and update["xla_peak_bytes"] > 16 * GiB  # XLA's own figure
    assert update["xla_capacity_bytes"] <= 16 * GiB
    mem = report["memory"]
    assert (mem["source"], mem["fits"], mem["peak_program"], mem["hbm_bytes"]) == ("xla", False, "update", 16 * GiB)
    assert "LoRA" in report["fix"]  # no remat or accumulation fits weights that large


def test_a_reward_models_program_is_compiled_and_its_weights_are_resident(aot):
    """issue 64: a reward model's scoring (rewards[].batch_size x max_length) is a program of the run,
    compiled on the reference's mesh; its weights are resident beside every other program; a batch
    that cannot fit is refused with XLA's figure, naming the reward model's settings."""
    from grpo_core.config.memory import RewardModelShape

    mc, train = get_preset("tiny", vocab_size=512), _train()
    rm = RewardModelShape(get_preset("tiny", vocab_size=512), batch_size=8, max_length=256, name="rm")
    cache = aot.ProgramCache()
    report = aot.check(mc, train, 16, Target.parse("v5e:2x2"), only=("reward_model",), reward_models=(rm,), cache=cache)
    update, scoring = report["programs"]
    assert scoring["program"] == "reward_model" and scoring["compiled"] and scoring["fits"]
    weights = report["resident_bytes"]["reward_models"]
    assert weights > 0 and weights == report["resident_bytes"]["reward_model_0"]
    assert update["resident_bytes"] >= weights and scoring["resident_bytes"] >= report["resident_bytes"]["params"]
    huge = RewardModelShape(rm.config, batch_size=1024, max_length=16384, name="rm")
    report = aot.check(
        mc, train, 16, Target.parse("v5e:2x2"), only=("reward_model",), reward_models=(huge,), cache=cache
    )
    scoring = report["programs"][1]
    assert not scoring["fits"] and scoring["xla_peak_bytes"] > 16 * GiB and not report["memory"]["fits"]
    assert "rewards[].batch_size or rewards[].max_length" in report["fix"]


@pytest.mark.slow  # end to end: two `grpo check` processes and the text (~55 s; make test runs it)
def test_grpo_check_target_json_then_cached(tmp_path):
    """`grpo check --target v5e:2x2 --json` compiles every program of the tiny run for 4 v5e chips in
    a process of its own; the same check again reads the report back."""
    env = dict(
        os.environ, GRPO_AOT_CACHE_DIR=str(tmp_path / "aot"), PREFECT_HOME=str(tmp_path / "prefect"), PYTHONPATH=ROOT
    )
    cmd = [
        sys.executable,
        "-m",
        "flows.cli",
        "check",
        "--target",
        "v5e:2x2",
        "--json",
        "--set",
        f"storage.root={tmp_path / 'runs'}",
        "--set",
        "eval.batch_size=8",
    ]

    def check(*more):
        t = time.perf_counter()
        proc = subprocess.run([*cmd, *more], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
        return json.loads(proc.stdout), time.perf_counter() - t

    report, _ = check()
    mem, target = report["memory"], report["target"]
    assert mem["source"] == "xla" and mem["hbm_bytes"] == 16 * GiB and 0 < mem["peak_bytes"] < mem["usable_bytes"]
    assert {p["program"] for p in target["programs"]} >= {"update", "prefill", "decode", "eval_prefill", "eval_decode"}
    assert all(p["compiled"] and p["fits"] and p["flops"] > 0 for p in target["programs"])
    assert target["mesh"] == "train data=1xfsdp=4xtensor=1" and not target["cached"]
    # evaluation generates over the rollout's mesh, as the worker runs it: a chip holds a quarter of
    # the f32 weights (on one chip its arguments would be all 1.4 MB of them)
    progs = {p["program"]: p for p in target["programs"]}
    assert progs["eval_prefill"]["argument_bytes"] < get_preset("tiny").num_params() * 4 / 2
    assert "memory_formula" in report  # the formula's estimate, kept beside XLA's
    names = {c["name"]: c for c in report["checks"]}
    assert names["memory"]["ok"] and "XLA on v5e:2x2" in names["memory"]["detail"]
    assert names["target"]["ok"] and "no TPU here" in names["target"]["detail"]
    _assert_the_estimate_counts_the_loops(report, tmp_path)
    again, _ = check()
    # read back, nothing compiled again (how fast a cached check answers is bench.aot's to say)
    assert again["target"]["cached"] and again["target"]["programs"] == target["programs"]
    assert again["memory"]["peak_bytes"] == mem["peak_bytes"]
    # a change that touches only evaluation compiles only evaluation: the rest is read back per program
    smaller, _ = check("--set", "eval.batch_size=4")
    fresh = {p["program"] for p in smaller["target"]["programs"] if not p["cached"]}
    assert not smaller["target"]["cached"] and fresh == {"eval_prefill", "eval_decode"}, fresh
    same = {p["program"]: p for p in target["programs"]}
    for p in smaller["target"]["programs"]:
        if p["cached"]:
            assert p["compile_s"] == 0.0 and p["xla_peak_bytes"] == same[p["program"]]["xla_peak_bytes"]
    # the text says the same, in a few lines (read back from the cache)
    text = subprocess.run(
        [c for c in cmd if c != "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    ).stdout
    assert "a roofline bound (a lower bound on time" in text and "197 TFLOP/s" in text and "819 GB/s" in text
    assert "run     >= " in text and f"{report['estimate']['num_steps']} steps x" in text
    assert "advice:  decode collects the learner's split weights" in text


def _assert_the_estimate_counts_the_loops(report: dict, tmp_path) -> None:
    """The speed estimate: a roofline bound on v5e's peaks from XLA's figures with every loop counted
    as it runs (the decode loop max_new_tokens - 1 times, the layers' scan once a layer), which
    cost_analysis() counts once: each bound below fails with the loops counted once."""
    from grpo_core.config.memory import Shapes
    from grpo_core.config.run import load_config
    from grpo_core.data.tokenizer import make_tokenizer
    from grpo_core.store.sources import model_config

    est = report["estimate"]
    assert est["peaks"] == Target.parse("v5e:2x2").peaks() and "lower bound" in est["basis"]
    assert est["step_s"] > 0 and est["rollout_tokens_per_s"] > 0 and est["run_s"] > 0
    assert est["run_s"] >= est["step_s"] * est["num_steps"] and est["run_includes_eval"]
    cfg = load_config(None, [f"storage.root={tmp_path / 'runs'}", "eval.batch_size=8"])
    params, chips = model_config(cfg, make_tokenizer(cfg).vocab_size).num_params(), 4
    s = Shapes.of(cfg.train, cfg.data.max_prompt_tokens)
    progs = {p["program"]: p for p in report["target"]["programs"]}
    timed = {r["program"]: r for r in est["programs"]}
    # every token step (of each phase of the decode loop) reads the rollout's weights and runs every layer for every row
    assert timed["decode"]["iterations"] == s.new_tokens - 1
    assert min(it["bytes"] for it in progs["decode"]["iterations"]) >= est["weight_bytes"]["rollout"] > 0
    assert timed["decode"]["flops"] >= 2 * params * s.rows * (s.new_tokens - 1) / chips
    # the update's forward and backward over each prompt once and each completion (6 x params x
    # tokens), where cost_analysis() counts one of the layers
    tokens = s.prompts * s.prompt_len + s.rows * s.new_tokens
    assert timed["update"]["flops"] >= 0.75 * 6 * params * tokens / chips > progs["update"]["flops"]
    assert est["split_s"]["update"] == timed["update"]["s"] * est["updates_per_step"]
    # the rollout shares the learner's fsdp=4 mesh: decode collects the split weights each token step
    [advice] = est["advice"]
    assert timed["decode"]["collective_bytes"] > 0 and 'train.mesh.rollout={"data": -1, "fsdp": 1}' in advice, advice


def test_a_report_is_read_back_only_by_the_code_that_wrote_it(tmp_path, monkeypatch):
    """The report's cache key holds a digest of grpo_core's source: the same config checked after
    a change to the code that builds the programs (here one line of a copied package) misses the
    report cache, so no stale figures are read back; the per-program cache decides what recompiles."""
    import shutil

    from grpo_core.stages import aot as stage

    req = {"model": get_preset("tiny").to_dict(), "train": {}, "max_prompt_tokens": 16, "target": "v5e:2x2"}
    copy = tmp_path / "grpo_core"
    shutil.copytree(os.path.dirname(stage._PACKAGE) + "/grpo_core", copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(stage, "_PACKAGE", str(copy))
    before = stage.cache_key(req)
    assert stage.cache_key(req) == before  # stable
    with open(copy / "nn" / "model.py", "a") as f:
        f.write("\n# a change\n")
    assert stage.cache_key(req) != before


def test_without_libtpu_the_check_says_what_to_install(tmp_path):
    """An interpreter without libtpu (its import blocked): the refusal names the extra to install."""
    req = tmp_path / "req.json"
    req.write_text(
        json.dumps({"model": get_preset("tiny").to_dict(), "train": {}, "max_prompt_tokens": 16, "target": "v5e:2x2"})
    )
    code = (
        "import sys, importlib.metadata as m\n"
        "real = m.version\n"
        "def version(name):\n"
        "    if name == 'libtpu': raise m.PackageNotFoundError(name)\n"
        "    return real(name)\n"
        "m.version = version\n"
        "from grpo_core.stages.aot import main\n"
        f"sys.exit(main(['--request', {str(req)!r}]))\n"
    )
    env = dict(os.environ, GRPO_AOT_CACHE_DIR=str(tmp_path / "aot"))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "pip install -c constraints.txt '.[tpu-aot]'" in json.loads(proc.stdout)["error"]


@pytest.mark.slow
def test_small_update_with_dots_remat_compiles_for_v6e(aot):
    """The small preset's update with dots remat for 4 v6e chips. One generation is enough here:
    the tiny update above compiles for v4 and v6e, the v5e recipe's (tests/test_recipes.py: the
    plan's choice at a real shape) for v5e, and dots remat for v5p above (12-15 CPU-s a compile:
    the suite's budget, issue 32)."""
    topology = "v6e:2x2"
    devices = aot.topology_devices(Target.parse(topology))
    run = aot.RunPrograms(get_preset("small"), _train(grpo={"prompts_per_step": 8}), 64, devices)
    compile_, extra = run.update(RematPolicy.DOTS, 1)
    r = aot.analyse("update", compile_, 0, Target.parse(topology).hbm_bytes)
    assert r["compiled"] and r["fits"] and r["flops"] > 0


def test_auto_memory_choices_on_the_local_backend_are_made_by_its_compiler(monkeypatch):
    """Where the device's memory is known (an accelerator's bytes_limit, or GRPO_DEVICE_MEMORY_BYTES:
    here a fake budget on the CPU backend) remat and grad_accum_steps at auto are chosen by XLA's
    memory_analysis() of each candidate update compiled for the local devices, not by the formula:
    a budget just under the cheapest candidate's figure makes the compiler pass it over for one
    that fits (accumulation 2 needs less than 1: 8.50 vs 8.70 MB here)."""
    from grpo_core.config import memory
    from grpo_core.rl import aot, compiler_plan

    tiny, train = get_preset("tiny"), _train(new_tokens=8, remat="full")  # grad_accum_steps: auto (1, 2, 4)
    monkeypatch.delenv(compiler_plan.BUDGET_ENV, raising=False)
    assert compiler_plan.device_budget() is None  # CPU, no setting: the formula chooses alone
    monkeypatch.setenv(compiler_plan.BUDGET_ENV, "lots")
    with pytest.raises(ConfigError, match="GRPO_DEVICE_MEMORY_BYTES must be a positive number of bytes, got 'lots'"):
        compiler_plan.device_budget()
    cache = aot.ProgramCache()
    monkeypatch.setenv(compiler_plan.BUDGET_ENV, str(2**40))
    roomy = compiler_plan.choose(tiny, train, 16, cache=cache)
    first = roomy["candidates"][0]
    assert roomy["source"] == "xla" and roomy["backend"] == "cpu" and roomy["fits"]
    assert len(roomy["candidates"]) == 1 and first["fits"] and first["xla_peak_bytes"] > 0
    budget = int((first["peak_bytes"] - 1) / aot.HEADROOM)  # one byte short for the cheapest
    tight = compiler_plan.choose(tiny, train, 16, budget=budget, cache=cache)
    assert tight["candidates"][0] == dict(first, fits=False, compile_s=0.0, cached=True)  # read back, not recompiled
    assert tight["fits"] and tight["peak_bytes"] <= tight["usable_bytes"] == int(aot.HEADROOM * budget)
    assert (first["remat"], first["grad_accum_steps"]) == ("full", 1) and tight["grad_accum_steps"] > 1
    assert all(not c["fits"] and c["peak_bytes"] > tight["usable_bytes"] for c in tight["candidates"][:-1])
    resolved = compiler_plan.resolve(train, tight)
    assert resolved.memory_resolved and resolved.grpo.grad_accum_steps == tight["grad_accum_steps"]
    assert compiler_plan.choose(tiny, resolved, 16, budget=budget) is None  # nothing left to choose
    # the formula, counting the whole process on CPU, says nothing fits such a budget: the choice is XLA's
    assert not memory.plan(tiny, train, 16, budget, backend="cpu").fits
