"""Rollout engines without sglang-jax: the shared interface, weight-sync planning, config and
hashing, readiness of each engine, and the time limits (HTTP calls, server start, watchdog).
sglang-jax itself runs in tests/test_sglang.py (its own interpreter)."""

import http.server
import json
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_core.config.model import DType
from grpo_core.config.presets import get_preset
from grpo_core.config.run import RunConfig
from grpo_core.config.train import RolloutConfig, TrainConfig
from grpo_core.engines import RolloutError, RolloutTimeout, finish_rows, make_engine, prompt_lists, row_seeds, wait_for
from grpo_core.engines.http import OwnedServer, request_json
from grpo_core.engines.sglang import make_converter, plan_sync, sampling_params, source_of
from grpo_core.errors import ConfigError
from grpo_core.rl.sampler import SamplerOptions, generate, pad_prompts, step_key
from grpo_core.stages.readiness import _engine_check


def test_finish_rows_keeps_the_stop_token_and_flags_truncation():
    g = finish_rows(
        [[4, 9, 2, 7], [5, 6, 8], [3]], [[-1, -2, -3, -4], [-1, -1, -1], [-0.5]], n=4, eos_ids=[2, 3], pad_id=0, who="t"
    )
    assert g.tokens.tolist() == [[4, 9, 2, 0], [5, 6, 8, 0], [3, 0, 0, 0]]  # cut after the first stop token
    assert g.lengths.tolist() == [3, 3, 1] and g.truncated.tolist() == [False, True, False]
    assert g.logprobs[0].tolist() == [-1, -2, -3, 0] and g.tokens.dtype == np.int32
    ignore = finish_rows([[3, 3]], [[-1, -1]], n=2, eos_ids=[], pad_id=0, who="t")  # ignore_eos: never done
    assert ignore.truncated.tolist() == [True] and ignore.lengths.tolist() == [2]
    with pytest.raises(RolloutError, match="row 0 has 5 tokens, more than max_new_tokens=4"):
        finish_rows([[1, 1, 1, 1, 1]], [[0] * 5], n=4, eos_ids=[2], pad_id=0, who="t")
    with pytest.raises(RolloutError, match="row 0 has 2 tokens but 1 log-probs"):
        finish_rows([[1, 1]], [[0]], n=4, eos_ids=[2], pad_id=0, who="t")


def test_prompts_and_seeds_per_row():
    ptok, pval = pad_prompts([[5, 6, 7], [8]], (4,), 0)
    assert prompt_lists(ptok, pval, 2) == [[5, 6, 7], [5, 6, 7], [8], [8]]
    a, b = row_seeds(step_key(0, 3), 8), row_seeds(step_key(0, 4), 8)
    assert np.array_equal(a, row_seeds(step_key(0, 3), 8)) and not np.array_equal(a, b) and len(set(a)) == 8
    sp = sampling_params(SamplerOptions(5, 0.7, 0, 0.9, (2,), 0), 2, a)
    assert sp[0]["top_k"] == -1 and sp[0]["stop_token_ids"] == [2] and not sp[0]["skip_special_tokens"]
    assert sp[1]["sampling_seed"] == int(a[1]) and "ignore_eos" not in sp[0]
    assert sampling_params(SamplerOptions(5, 1.0, 4, 1.0, (), 0), 1, None)["ignore_eos"] is True


def test_jax_engine_is_the_sampler():
    from flax import nnx

    from grpo_core.nn.model import create_model

    cfg = get_preset("tiny", vocab_size=40)
    graphdef, params = nnx.split(create_model(cfg, 0))
    opts = SamplerOptions(6, 1.0, 0, 1.0, (0,), 0)
    engine = make_engine(
        RolloutConfig(), graphdef=graphdef, params_fn=lambda: params, model_config=cfg, opts=opts, batch_size=4
    )
    ptok, pval = pad_prompts([[3, 4, 5], [6, 7]], (4,), 0)
    got = engine.generate(ptok, pval, step_key(1, 2), 2)
    c = generate(graphdef, params, ptok, pval, step_key(1, 2), opts, 2)
    for mine, ref in zip(
        (got.tokens, got.logprobs, got.lengths, got.truncated), (c.tokens, c.logprobs, c.lengths, c.truncated)
    ):
        assert isinstance(mine, np.ndarray) and np.array_equal(mine, np.asarray(ref))
    assert engine.sync(None, 1) == 0.0 and engine.synced_step == 1


def _stacked_params(layers=2, e=8, k=1, d=4, v=10, tied=False):
    """Our flat parameter layout for a qwen3-shaped model: stacked (L, ...) layer parameters."""
    r = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(r.normal(size=s).astype(np.float32))
    flat = {
        ("model", "embed_tokens", "embedding"): w(v, e),
        ("model", "norm", "weight"): w(e),
        ("model", "layers", "input_layernorm", "weight"): w(layers, e),
        ("model", "layers", "self_attn", "q_proj", "kernel"): w(layers, e, 2 * d),
        ("model", "layers", "self_attn", "k_proj", "kernel"): w(layers, e, k * d),
        ("model", "layers", "self_attn", "k_norm", "weight"): w(layers, d),
    }
    if not tied:
        flat[("lm_head", "kernel")] = w(e, v)
    return flat


def _leaf(shape, dtype="bfloat16"):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def test_sync_plan_maps_engine_leaves_to_policy_parameters():
    assert source_of("model.layers.3.mlp.down_proj.weight") == (
        ("model", "layers", "mlp", "down_proj", "kernel"),
        3,
        False,
    )
    assert source_of("model.layers.0.self_attn.q_norm.scale") == (
        ("model", "layers", "self_attn", "q_norm", "weight"),
        0,
        False,
    )
    assert source_of("lm_head.embedding") == (("lm_head", "kernel"), None, True)
    flat = _stacked_params()
    names = ["lm_head.embedding", "model.embed_tokens.embedding", "model.norm.scale"]
    leaves = [_leaf((10, 8)), _leaf((10, 8)), _leaf((8,))]
    for i in range(2):  # tensor parallelism 2 over one k/v head: the engine's k_proj is twice as wide
        names += [
            f"model.layers.{i}.input_layernorm.scale",
            f"model.layers.{i}.self_attn.q_proj.weight",
            f"model.layers.{i}.self_attn.k_proj.weight",
            f"model.layers.{i}.self_attn.k_norm.scale",
        ]
        leaves += [_leaf((8,)), _leaf((8, 8)), _leaf((8, 8)), _leaf((4,))]
    plan = plan_sync(names, leaves, flat)
    out = dict(zip(names, make_converter(plan, head_dim=4)(flat)))
    head = np.asarray(flat[("lm_head", "kernel")]).T
    assert out["lm_head.embedding"].dtype == jnp.bfloat16 and np.allclose(
        np.asarray(out["lm_head.embedding"], np.float32), head, rtol=1e-2, atol=1e-2
    )
    q1 = np.asarray(flat[("model", "layers", "self_attn", "q_proj", "kernel")][1])
    assert np.allclose(np.asarray(out["model.layers.1.self_attn.q_proj.weight"], np.float32), q1, rtol=1e-2, atol=1e-2)
    k0 = np.asarray(out["model.layers.0.self_attn.k_proj.weight"], np.float32)
    assert np.array_equal(k0[:, :4], k0[:, 4:])  # the one head, repeated for the second shard
    with pytest.raises(RolloutError, match="q_proj.weight has shape \\(8, 6\\), the policy's .* gives \\(8, 8\\)"):
        plan_sync(names[:5], leaves[:4] + [_leaf((8, 6))], flat)
    with pytest.raises(RolloutError, match="feed no sglang-jax parameter"):
        plan_sync(names[:3], leaves[:3], flat)
    with pytest.raises(RolloutError, match="no counterpart in the policy"):
        plan_sync(["model.layers.0.mlp.gate_proj.weight"], [_leaf((8, 16))], flat)


def test_rollout_config_validation_and_hash():
    with pytest.raises(ConfigError, match="needs exactly one of train.rollout.url"):
        RolloutConfig(engine="http")
    with pytest.raises(ConfigError, match="cannot restart: set train.rollout.reload_route"):
        RolloutConfig(engine="http", url="http://10.0.0.2:30000")
    with pytest.raises(ConfigError, match="must name the model folder as \\{model\\}"):
        RolloutConfig(engine="http", server_command=["vllm", "serve"])
    with pytest.raises(ConfigError, match="train.rollout.engine must be one of jax, sglang, http; got 'vllm'"):
        RolloutConfig(engine="vllm")
    assert RolloutConfig(engine="sglang-jax").engine.value == "sglang"
    assert RolloutConfig(engine="sglang").learner_logprobs()
    assert RolloutConfig(engine="http", server="sglang-jax").learner_logprobs()  # another engine's kernels
    assert not RolloutConfig().learner_logprobs() and RolloutConfig().learner_logprobs(DType.BFLOAT16)
    assert not RolloutConfig(engine="http", server="sglang-jax", recompute_logprobs=False).learner_logprobs()
    base = RunConfig.from_dict({})
    same = RunConfig.from_dict({"train": {"rollout": {"engine": "jax", "generate_timeout_s": 5}}})
    assert same.train_hash == base.train_hash  # the built-in engine and time limits change no result
    sgl = RunConfig.from_dict({"train": {"rollout": {"engine": "sglang"}}})
    sgl_slow = RunConfig.from_dict(
        {"train": {"rollout": {"engine": "sglang", "start_timeout_s": 30, "max_total_tokens": 99}}}
    )
    assert sgl.train_hash != base.train_hash and sgl.train_hash == sgl_slow.train_hash
    rt = TrainConfig.from_dict(sgl.train.to_dict())
    assert rt == sgl.train and rt.rollout.engine.value == "sglang"


def test_readiness_engine_checks():
    tiny = get_preset("tiny", vocab_size=40)
    hd128 = get_preset("tiny", vocab_size=40, num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    sgl = RolloutConfig(engine="sglang")
    rep = lambda backend, gen=None, procs=1: {"backend": backend, "tpu_generation": gen, "process_count": procs}
    old = _engine_check(sgl.engine, rep("tpu", 3), tiny, sgl)
    assert not old["ok"] and "TPU v4 or newer" in old["detail"] and "found TPU v3" in old["detail"]
    assert "train.rollout.engine=jax" in old["fix"]
    multi = _engine_check(sgl.engine, rep("tpu", 4, procs=2), tiny, sgl)
    assert not multi["ok"] and "multi-host" in multi["detail"] and "engine=jax" in multi["fix"]
    cpu32 = _engine_check(sgl.engine, rep("cpu"), tiny, sgl)
    assert not cpu32["ok"] and "head_dim 32" in cpu32["detail"]
    cpu128 = _engine_check(sgl.engine, rep("cpu"), hd128, sgl)  # this interpreter lacks sglang-jax
    assert not cpu128["ok"] and "not installed" in cpu128["detail"] and "make sglang-env" in cpu128["fix"]
    assert _engine_check(RolloutConfig().engine, rep("tpu", 2, procs=4), tiny)["ok"]
    down = RolloutConfig(engine="http", url="http://127.0.0.1:9", reload_route="/update_weights_from_disk")
    gone = _engine_check(down.engine, rep("cpu"), tiny, down)
    assert not gone["ok"] and "did not answer" in gone["detail"] and "train.rollout.url" in gone["fix"]


class _Handler(http.server.BaseHTTPRequestHandler):
    calls: list = []

    def do_POST(self):  # noqa: N802
        n = int(self.headers["Content-Length"])
        body = json.loads(self.rfile.read(n))
        _Handler.calls.append((self.path, body))
        if self.path == "/slow":
            time.sleep(2)
        code = {"/bad": 400, "/flaky": 500 if len(_Handler.calls) == 1 else 200}.get(self.path, 200)
        data = json.dumps({"ok": self.path, "echo": body}).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    _Handler.calls = []
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_http_calls_have_time_limits_and_retries(server):
    assert request_json("POST", f"{server}/flaky", {"a": 1}, 5, 1, "x")["echo"] == {"a": 1}  # a 500, then retried
    assert len(_Handler.calls) == 2
    with pytest.raises(RolloutError, match="refused: HTTP 400"):
        request_json("POST", f"{server}/bad", {}, 5, 3, "x")
    t = time.perf_counter()
    with pytest.raises(RolloutTimeout, match=r"/slow \(8 completions\): no answer within 0.3 s \(after 2 attempts\)"):
        request_json("POST", f"{server}/slow", {}, 0.3, 1, "8 completions")
    assert time.perf_counter() - t < 5
    with pytest.raises(RolloutTimeout, match="waited 0.2 s for a stuck sync"):
        wait_for(lambda: time.sleep(3), 0.2, "a stuck sync")
    assert wait_for(lambda: 7, 1, "x") == 7


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_owned_server_start_is_bounded_and_stops_its_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    sleeper = [
        sys.executable,
        "-c",
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pidfile)!r}, 'w').write(str(c.pid)); time.sleep(60)",
        "{model}",
    ]
    srv = OwnedServer(sleeper, {}, str(tmp_path), start_timeout_s=1.5)
    with pytest.raises(
        RolloutTimeout, match=r"waited 1.5 s for the rollout server to answer http://127.0.0.1:\d+/health"
    ):
        srv.start("m")
    assert srv.proc is None and pidfile.exists()
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)  # the server's own child went with its process group
    dies = OwnedServer(
        [sys.executable, "-c", "import sys; print('no model', sys.argv[1]); sys.exit(3)", "{model}"],
        {},
        str(tmp_path),
        start_timeout_s=30,
    )
    with pytest.raises(RolloutError, match="exited with code 3 while starting(.|\n)*no model /some/folder"):
        dies.start("/some/folder")


def test_watchdog_ends_a_stuck_process_with_its_reason():
    code = (
        "import time; from grpo_core.engines import watchdog\n"
        "with watchdog(0.5, 'the engine to start (train.rollout.start_timeout_s)'):\n    time.sleep(30)"
    )
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 7 and time.perf_counter() - t < 20
    assert "waited 0.5 s for the engine to start (train.rollout.start_timeout_s)" in proc.stderr


def test_an_export_dir_is_never_cleared_of_what_the_run_did_not_write(tmp_path):
    """issue 52: train.rollout.export_dir=/any/dir made the worker remove /any/dir/step-0 with what
    was in it. Only a folder an export of this pipeline wrote (its mark inside) is replaced."""
    from grpo_core.engines.http import EXPORT_MARK, _clear_own_export
    from grpo_core.errors import ConfigError

    theirs = tmp_path / "step-0"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match=r"^train\.rollout\.export_dir: .*step-0 exists and was not written"):
        _clear_own_export(str(theirs))
    assert (theirs / "notes.txt").read_text() == "keep me"
    link = tmp_path / "step-1"
    link.symlink_to(theirs)
    with pytest.raises(ConfigError):
        _clear_own_export(str(link))
    assert (theirs / "notes.txt").exists() and link.is_symlink()
    ours = tmp_path / "step-2"
    ours.mkdir()
    (ours / EXPORT_MARK).write_text("step 2\n")
    (ours / "model.safetensors").write_bytes(b"0")
    _clear_own_export(str(ours))  # an earlier attempt's export: replaced
    assert not ours.exists()
    (tmp_path / "step-3").mkdir()
    _clear_own_export(str(tmp_path / "step-3"))  # empty: written into
    _clear_own_export(str(tmp_path / "step-4"))  # nothing there


class _Target(http.server.BaseHTTPRequestHandler):
    """A server no config named: counts what reaches it."""

    calls: list = []

    def _answer(self):
        _Target.calls.append(self.path)
        data = b'{"data": [{"id": "TARGET-SECRET-BODY"}]}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer  # noqa: N815

    def log_message(self, *args):
        pass


def _redirector(to: str):
    class Redirect(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            n = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(n)
            code = 307 if self.command == "POST" else 302
            body = b"moved \x1b[31m" + b"x" * 5000  # a body it would echo: never quoted whole, never raw
            self.send_response(code)
            self.send_header("Location", f"{to}{self.path}")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer  # noqa: N815

        def log_message(self, *args):
            pass

    return Redirect


@pytest.fixture
def redirect_to_target():
    """(the allowed address, which answers every call with a redirect to the target; the target's calls)."""
    servers = []
    for handler in (_Target, None):
        httpd = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), handler or _redirector(f"http://127.0.0.1:{servers[0].server_address[1]}")
        )
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
    _Target.calls = []
    yield f"http://127.0.0.1:{servers[1].server_address[1]}", f"127.0.0.1:{servers[0].server_address[1]}"
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def test_the_http_engine_follows_no_redirect(redirect_to_target, tmp_path):
    """issue 61: train.rollout.url at an allowed 127.0.0.1:P that answers 302 to another port was
    followed (7 requests) and that server's body echoed in the error. Now a 3xx is a ConfigError
    naming train.rollout.url and where it pointed, the target is never asked, and nothing of
    the body is quoted; the readiness probe does not follow it either."""
    from flax import nnx

    from grpo_core.nn.model import create_model

    allowed, target = redirect_to_target
    tiny = get_preset("tiny", vocab_size=40)
    graphdef, params = nnx.split(create_model(tiny, 0))
    rollout = RolloutConfig(engine="http", url=allowed, reload_route="/reload", export_dir=str(tmp_path / "export"))
    engine = make_engine(
        rollout,
        graphdef=graphdef,
        params_fn=lambda: params,
        model_config=tiny,
        opts=SamplerOptions(6, 1.0, 0, 1.0, (0,), 0),
        batch_size=2,
    )
    with pytest.raises(ConfigError) as err:
        engine.sync(params, 0)  # the export, then POST /reload: a 307
    msg = str(err.value)
    assert msg.startswith(f"train.rollout.url: POST {allowed}/reload (reloading the weights of step 0")
    assert f"HTTP 307, a redirect to 'http://{target}/reload', which is not followed" in msg
    with pytest.raises(ConfigError, match=rf"^train\.rollout\.url: GET {allowed}/v1/models .* HTTP 302, a redirect "):
        engine.model_name()
    assert "moved" not in msg and msg.isprintable() and "TARGET-SECRET" not in msg
    report = _engine_check(
        rollout.engine, {"backend": "cpu", "tpu_generation": None, "process_count": 1}, tiny, rollout
    )
    assert not report["ok"] and f"a redirect to 'http://{target}/v1/models' (not followed)" in report["detail"]
    assert "train.rollout.url" in report["fix"]
    assert _Target.calls == []  # the address no config named was never asked
    engine.close()


def test_an_error_answer_is_quoted_short_and_printable(server):
    """A 4xx's body: at most 200 printable characters of the named server's own answer."""
    _Handler.calls = []
    with pytest.raises(RolloutError) as err:
        request_json("POST", f"{server}/bad", {"pad": "\x1b[2J" + "y" * 3000}, 5, 0, "x")
    msg = str(err.value)
    assert 'refused: HTTP 400: \'{"ok": "/bad"' in msg and msg.isprintable()
    assert len(msg) < 350 and msg.endswith("'...")  # 200 characters of a 3 kB answer
