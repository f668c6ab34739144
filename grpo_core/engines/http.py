"""Rollouts from an OpenAI-compatible server: sglang-jax, SGLang or vLLM in server mode.

Each rollout is one request: the B = P * G prompts as token-id lists, max_tokens, temperature,
top-p/top-k, the stop token ids (or ignore_eos), special tokens kept, and per-token log-probs
(`api: openai`: POST /v1/completions with logprobs=1; `api: sglang`: POST /generate with
input_ids and return_logprob, which SGLang and sglang-jax answer with exact token ids). Every
request has a time limit and is retried; the error names the URL and what was waited for. No
redirect is followed (grpo_core.addresses): a 3xx is a ConfigError naming train.rollout.url and
where it pointed, so a call reaches only the host and port the trust policy allowed, and an error
quotes at most a short printable excerpt of that server's own answer.

Token ids from /v1/completions: vLLM returns them when asked (`return_tokens_as_token_ids`,
"token_id:123"); sglang-jax and SGLang return each token's text, which is mapped back through the
exported tokenizer's single-token decodings and refused when ambiguous (byte-level BPE pieces
decode to the same replacement character): use `api: sglang` there.

Weights: every `sync_every` steps the policy is exported as a Hugging Face folder (config.json,
model.safetensors, tokenizer) under `export_dir`, then served:
- `reload_route` (SGLang: /update_weights_from_disk) is POSTed {"model_path": folder} on a
  server at `url`, which must be able to read the folder;
- `server: sglang-jax` or `server_command`: the server is this engine's own child process on
  127.0.0.1 and is restarted on the new folder (sglang-jax has no weight-reload route), its
  start bounded by start_timeout_s. It runs in its own process group, stopped by that group.
On a TPU VM the learner holds the TPU, so a server started here runs on the host's CPU (or
another accelerator); a production TPU setup points `url` at a server on other hosts.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

import jax
from flax import nnx

from grpo_core.addresses import answer_excerpt, open_url, redirect_of
from grpo_core.engines import (
    Completions,
    RolloutError,
    RolloutTimeout,
    finish_rows,
    prompt_lists,
    row_seeds,
    wait_for,
)
from grpo_core.engines.sglang import sampling_params, sglang_jax_args
from grpo_core.errors import ConfigError, excerpt
from grpo_core.launch.processes import free_port, sglang_python, stop_process_groups
from grpo_core.nn.hf import save_hf_model
from grpo_core.nn.model import CausalLM

log = logging.getLogger(__name__)


def request_json(
    method: str,
    url: str,
    body: dict | None,
    timeout_s: float,
    retries: int,
    what: str,
    field: str = "train.rollout.url",
) -> Any:
    """One JSON call with a time limit per attempt and `retries` more attempts after a timeout,
    a refused connection or a 5xx; a 4xx fails at once with (a short excerpt of) the server's
    message. A redirect is not followed: ConfigError naming `field` (the setting that named the
    server) and where it pointed."""
    data = None if body is None else json.dumps(body).encode()
    last = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(min(2.0 ** (attempt - 1), 10.0))
        req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with open_url(req, timeout=timeout_s) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            where = redirect_of(exc)
            if where is not None:
                raise ConfigError(
                    f"{field}: {method} {url} ({what}) answered HTTP {exc.code}, a redirect to {where}, which is not "
                    f"followed: set {field} to the address of the server itself"
                ) from None
            text = answer_excerpt(exc)
            if exc.code < 500:
                raise RolloutError(f"{method} {url} ({what}) was refused: HTTP {exc.code}: {text}") from None
            last = f"HTTP {exc.code}: {text}"
        except (TimeoutError, socket.timeout):
            last = f"no answer within {timeout_s:g} s"
        except (urllib.error.URLError, ConnectionError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, (TimeoutError, socket.timeout)):
                last = f"no answer within {timeout_s:g} s"
            else:
                last = f"{type(reason).__name__}: {reason}"
        except json.JSONDecodeError as exc:
            last = f"not JSON: {exc}"
    cls = RolloutTimeout if last.startswith("no answer") else RolloutError
    raise cls(f"{method} {url} ({what}): {last} (after {retries + 1} attempts)")


class OwnedServer:
    """A server process this engine starts, restarts on a new model folder, and stops by its
    own process group (start_new_session: the server's own children go with it)."""

    def __init__(self, command: list[str], env: dict[str, str], log_dir: str, start_timeout_s: float):
        self.template, self.env, self.log_dir, self.start_timeout_s = command, env, log_dir, start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.starts = 0

    def start(self, model: str) -> float:
        self.stop()
        port = free_port()
        fill = {"model": model, "port": str(port), "host": "127.0.0.1", "python": sglang_python() or "python"}
        cmd = [a.format(**fill) for a in self.template]
        self.starts += 1
        self.log_path = os.path.join(self.log_dir, f"server-{self.starts}.log")
        t = time.perf_counter()
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **self.env},
            )
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RolloutError(
                    f"the rollout server exited with code {self.proc.returncode} while starting: "
                    f"{' '.join(cmd)}\n{self.tail()}"
                )
            try:
                with open_url(f"{self.url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return time.perf_counter() - t
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() >= deadline:
                self.stop()
                raise RolloutTimeout(
                    f"waited {self.start_timeout_s:g} s for the rollout server to answer {self.url}/health "
                    f"(train.rollout.start_timeout_s): {' '.join(cmd)}\n{self.tail()}"
                )
            time.sleep(0.25)

    def tail(self, n: int = 3000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except (OSError, AttributeError):
            return ""

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the server's process group, then SIGKILL whatever is left of it."""
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_process_groups([proc], grace_s, whole_group=True)


def sglang_jax_command(cfg, device: str, dtype: str, batch_size: int, max_new_tokens: int, seed: int) -> list[str]:
    """sglang-jax's launch_server for this policy, with {model}, {host} and {port} left to fill in:
    the arguments the in-process engine starts with (grpo_core.engines.sglang.sglang_jax_args) as
    `--flag value` (a true switch as `--flag`, a false one left out), then cfg.server_args."""
    python = sglang_python()
    if python is None:
        raise RolloutError(
            "train.rollout.server=sglang-jax needs the sglang-jax environment: run `make sglang-env` "
            "(builds .venv-sglang) or set GRPO_SGLANG_PYTHON to its python"
        )
    args = sglang_jax_args(
        cfg,
        "{model}",
        device=device,
        dtype=dtype,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        seed=seed,
        host="{host}",
        port="{port}",
    )
    cmd = [python, "-m", "sgl_jax.launch_server"]
    for name, value in args.items():
        if isinstance(value, bool):
            cmd += [f"--{name.replace('_', '-')}"] if value else []
        else:
            cmd += [f"--{name.replace('_', '-')}", str(value)]
    return cmd + list(cfg.server_args)


class HttpEngine:
    name = "http"

    def __init__(self, cfg, graphdef, model_config, opts, batch_size: int, tokenizer=None, seed: int = 0):

        self.cfg, self.opts, self.batch_size, self.tokenizer = cfg, opts, batch_size, tokenizer
        self.model_config = model_config
        # The plain model's graph: the engine exports plain weights (LoRA merged by the trainer).
        self.plain_graphdef = nnx.graphdef(nnx.eval_shape(lambda: CausalLM(model_config, rngs=nnx.Rngs(0))))
        self.synced_step: int | None = None
        self.served_step: int | None = None
        self.folder: str | None = None
        self._own_export = cfg.export_dir is None
        self.export_root = cfg.export_dir or tempfile.mkdtemp(prefix="grpo-rollout-export-")
        os.makedirs(self.export_root, exist_ok=True)
        self._texts: dict[str, list[int]] | None = None
        self._model_name = cfg.model_name
        self.sync_times: list[float] = []
        self.server: OwnedServer | None = None
        self.base_url = cfg.url.rstrip("/") if cfg.url else None
        # the setting that named the server an error is about: its address, or the server this engine starts
        self.field = "train.rollout." + ("server_command" if cfg.server_command else "server" if cfg.server else "url")
        device = "cpu" if jax.default_backend() == "cpu" else "tpu"
        dtype = cfg.dtype or model_config.dtype.value
        if cfg.server or cfg.server_command:
            cmd = (
                sglang_jax_command(cfg, device, dtype, batch_size, opts.max_new_tokens, seed)
                if cfg.server
                else list(cfg.server_command)
            )
            env = {"JAX_PLATFORMS": "cpu"} if device == "cpu" else {}
            self.server = OwnedServer(cmd, env, self.export_root, cfg.start_timeout_s)

    def compile_jobs(self, prompt_tokens, prompt_valid, key, num_samples: int):
        return []

    # -- weights ---------------------------------------------------------------------------

    def _export(self, params, step: int) -> str:

        folder = os.path.join(self.export_root, f"step-{step}")
        _clear_own_export(folder)
        save_hf_model(nnx.merge(self.plain_graphdef, params), folder)
        if self.tokenizer is not None and hasattr(self.tokenizer, "save_pretrained"):
            self.tokenizer.save_pretrained(folder)
        with open(os.path.join(folder, EXPORT_MARK), "w") as f:  # last: what _clear_own_export may remove
            f.write(f"step {step}\n")
        return folder

    def sync(self, params, step: int) -> float:
        """Every sync_every steps (and on the first call): export, then make the server serve it."""
        self.synced_step = step
        if self.served_step is not None and step - self.served_step < self.cfg.sync_every:
            return 0.0
        t = time.perf_counter()
        what = f"the export of step {step} for the rollout server (train.rollout.sync_timeout_s)"
        folder = wait_for(lambda: self._export(params, step), self.cfg.sync_timeout_s, what)
        if self.server is not None:
            self.server.start(folder)
            self.base_url = self.server.url
        else:
            request_json(
                "POST",
                f"{self.base_url}{self.cfg.reload_route}",
                {"model_path": folder},
                self.cfg.sync_timeout_s,
                self.cfg.request_retries,
                f"reloading the weights of step {step} (train.rollout.sync_timeout_s)",
                self.field,
            )
        if self.folder and self.folder != folder and self._own_export:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.folder, self.served_step = folder, step
        if self.server is not None or self.cfg.model_name is None:
            self._model_name = self.cfg.model_name
        dt = time.perf_counter() - t
        self.sync_times.append(dt)
        log.info("rollout server serves step %d (%s) after %.2f s", step, folder, dt)
        return dt

    # -- generation ------------------------------------------------------------------------

    def _call(self, path: str, body: dict, what: str) -> Any:
        return request_json(
            "POST",
            f"{self.base_url}{path}",
            body,
            self.cfg.generate_timeout_s,
            self.cfg.request_retries,
            f"{what} (train.rollout.generate_timeout_s)",
            self.field,
        )

    def model_name(self) -> str:
        if self._model_name is None:
            listed = request_json(
                "GET",
                f"{self.base_url}/v1/models",
                None,
                self.cfg.generate_timeout_s,
                self.cfg.request_retries,
                "the served model's name",
                self.field,
            )
            try:
                self._model_name = listed["data"][0]["id"]
            except (KeyError, IndexError, TypeError):
                raise RolloutError(
                    f"{self.base_url}/v1/models lists no model ({excerpt(json.dumps(listed), 200)}): "
                    "set train.rollout.model_name"
                )
        return self._model_name

    def generate(self, prompt_tokens, prompt_valid, key, num_samples: int) -> Completions:
        if self.base_url is None or self.served_step is None:
            raise RolloutError("the rollout server serves no policy yet: sync() before generating")
        ids = prompt_lists(prompt_tokens, prompt_valid, num_samples)
        o = self.opts
        if self.cfg.api.value == "sglang":
            seeds = row_seeds(key, len(ids)) if self.cfg.deterministic else None
            out = self._call(
                "/generate",
                {"input_ids": ids, "sampling_params": sampling_params(o, len(ids), seeds), "return_logprob": True},
                f"{len(ids)} completions",
            )
            out = out if isinstance(out, list) else [out]
            rows = [r["output_ids"] for r in out]
            lps = [[float(p[0]) for p in r["meta_info"]["output_token_logprobs"]] for r in out]
        else:
            body = {
                "model": self.model_name(),
                "prompt": ids,
                "max_tokens": o.max_new_tokens,
                "temperature": o.temperature,
                "top_p": o.top_p,
                "logprobs": 1,
                "n": 1,
                "skip_special_tokens": False,
                "return_tokens_as_token_ids": True,
            }  # vLLM: ids as "token_id:N"; others ignore it
            if o.top_k > 0:
                body["top_k"] = o.top_k
            if o.eos_ids:
                body["stop_token_ids"] = [int(e) for e in o.eos_ids]
            else:
                body["ignore_eos"] = True
            out = self._call("/v1/completions", body, f"{len(ids)} completions")
            choices = sorted(out.get("choices", []), key=lambda c: c["index"])
            if len(choices) != len(ids):
                raise RolloutError(
                    f"{self.base_url}/v1/completions answered {len(choices)} choices for {len(ids)} prompts"
                )
            rows, lps = [], []
            for c in choices:
                lp = c.get("logprobs") or {}
                if "token_logprobs" not in lp:
                    raise RolloutError(f"{self.base_url}/v1/completions returned no per-token log-probs")
                rows.append(self._token_ids(lp["tokens"]))
                lps.append([float(x) for x in lp["token_logprobs"]])
        return finish_rows(rows, lps, o.max_new_tokens, o.eos_ids, o.pad_id, f"rollout server {self.base_url}")

    def _token_ids(self, tokens: list[str]) -> list[int]:
        if tokens and all(t.startswith("token_id:") for t in tokens):
            return [int(t[len("token_id:") :]) for t in tokens]
        texts = self._decodings()
        out = []
        for t in tokens:
            ids = texts.get(t, [])
            if len(ids) != 1:
                raise RolloutError(
                    f"the rollout server returned token text {excerpt(t)}, which the tokenizer decodes from "
                    f"{'no id' if not ids else f'{len(ids)} ids'}: token ids cannot be recovered from "
                    "/v1/completions here; use train.rollout.api=sglang (/generate returns ids) or a "
                    "server that returns ids (vLLM: return_tokens_as_token_ids)"
                )
            out.append(ids[0])
        return out

    def _decodings(self) -> dict[str, list[int]]:
        """Each token id's text as the server's tokenizer decodes it alone (special tokens kept)."""
        if self._texts is None:
            from transformers import AutoTokenizer  # heavy: only an engine with a server tokenizer needs it

            tok = AutoTokenizer.from_pretrained(self.folder)
            texts: dict[str, list[int]] = {}
            for i, text in enumerate(tok.batch_decode([[i] for i in range(len(tok))])):
                texts.setdefault(text, []).append(i)
            self._texts = texts
        return self._texts

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self._own_export:
            shutil.rmtree(self.export_root, ignore_errors=True)


EXPORT_MARK = ".grpo-rollout-export"  # in each folder an export wrote, last


def _clear_own_export(folder: str) -> None:
    """Make room for an export at `folder`: an earlier export of this engine (its mark inside, e.g.
    an attempt killed before it synced) is replaced; anything else there is the user's and is
    never removed (ConfigError naming train.rollout.export_dir)."""
    if not os.path.lexists(folder):
        return
    if os.path.isdir(folder) and not os.path.islink(folder) and os.path.isfile(os.path.join(folder, EXPORT_MARK)):
        shutil.rmtree(folder)
        return
    if os.path.isdir(folder) and not os.path.islink(folder) and not os.listdir(folder):
        return  # an empty folder: written into, nothing lost
    raise ConfigError(
        f"train.rollout.export_dir: {folder} exists and was not written by an export of this pipeline; "
        "it is left as it is. Point train.rollout.export_dir at an empty folder (or leave it empty: a temp folder)"
    )
