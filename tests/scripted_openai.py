"""A scripted OpenAI-compatible completions server on 127.0.0.1, for the http rollout engine's tests
(grpo_core/engines/http.py): it answers what HttpEngine asks (GET /v1/models, POST /v1/completions
with token-id prompts, the weight-reload route) and plays a policy that calls a tool the way
Qwen's chat template writes calls. A random tiny model never writes a <tool_call> by itself; this
server does, so a run's episodes exercise the parsing, the tools and the results rendered through
the chat template.

The policy reads each prompt (token ids, decoded with the model folder's tokenizer, special tokens
kept): with no <tool_response> in it yet, it calls `add` on the first two numbers of the last
user turn (`<tool_call>\\n{"name": "add", "arguments": {"a": A, "b": B}}\\n</tool_call><|im_end|>`);
with one, it answers with the result (`The answer is R. #### R<|im_end|>`); a question without
two numbers it answers at once. Its token ids are the tokenizer's encoding of that text, cut as a
server cuts them (after the first of the request's stop_token_ids, at max_tokens), returned as
vLLM returns them with return_tokens_as_token_ids ("token_id:N"), each with a log-prob that depends
only on its position (`logprob_at`), so a test can tell them from anything else.

Stopped by its own handle (`close`), never by name."""

from __future__ import annotations

import http.server
import json
import os
import re
import threading
from typing import Any

MODEL_ID = "scripted-policy"
RELOAD_ROUTE = "/update_weights_from_disk"


def logprob_at(k: int) -> float:
    """The log-prob the server gives the k-th token of a completion."""
    return -0.5 - (k % 7) / 10


def reply(prompt: str) -> str:
    """The policy's turn after `prompt` (the conversation as the chat template rendered it)."""
    _, seen, result = prompt.rpartition("<tool_response>\n")
    if seen:
        value = result.split("\n</tool_response>", 1)[0]
        return f"The answer is {value}. #### {value}<|im_end|>"
    question = prompt.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]
    numbers = [int(x) for x in re.findall(r"\d+", question)]
    if len(numbers) < 2:
        return "Hello.<|im_end|>"
    call = {"name": "add", "arguments": {"a": numbers[0], "b": numbers[1]}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>"


class ScriptedServer:
    """The server and what it was asked: `completions` (each request: its body and its prompts
    decoded), `reloads` (each reload's model_path and the files in that folder at the time), and
    both in the order they came (`events`)."""

    def __init__(self, model_folder: str):
        from transformers import AutoTokenizer  # heavy: only this server's tests need it

        self.tok = AutoTokenizer.from_pretrained(model_folder)
        self.completions: list[dict[str, Any]] = []
        self.reloads: list[dict[str, Any]] = []
        self.events: list[tuple[str, Any]] = []  # ("completions", rows) and ("reload", folder name), in order
        self.models_asked = 0
        self.errors: list[str] = []  # requests it could not read (answered 400)
        self.lock = threading.Lock()
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True, name="scripted-openai")
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        stops = set(body.get("stop_token_ids") or [])
        most = int(body["max_tokens"])
        texts, choices = [], []
        for i, prompt in enumerate(body["prompt"]):
            text = self.tok.decode(prompt, skip_special_tokens=False)
            texts.append(text)
            ids = self.tok.encode(reply(text), add_special_tokens=False)
            end = next((k + 1 for k, t in enumerate(ids) if t in stops), len(ids))
            ids = ids[: min(end, most)]
            choices.append(
                {
                    "index": i,
                    "text": self.tok.decode(ids, skip_special_tokens=False),
                    "logprobs": {
                        "tokens": [f"token_id:{t}" for t in ids],
                        "token_logprobs": [logprob_at(k) for k in range(len(ids))],
                    },
                    "finish_reason": "stop" if len(ids) == end else "length",
                }
            )
        with self.lock:
            self.completions.append({"body": body, "prompts": texts})
            self.events.append(("completions", len(texts)))
        return {
            "id": f"cmpl-{len(self.completions)}",
            "object": "text_completion",
            "model": MODEL_ID,
            "choices": choices,
        }

    def reload(self, body: dict[str, Any]) -> dict[str, Any]:
        folder = body["model_path"]
        with self.lock:
            self.reloads.append({"model_path": folder, "files": sorted(os.listdir(folder))})
            self.events.append(("reload", os.path.basename(folder)))
        return {"success": True, "message": f"loaded {folder}"}


def _handler(server: ScriptedServer):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path != "/v1/models":
                return self._send(404, {"error": f"no route {self.path}"})
            server.models_asked += 1
            self._send(200, {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]})

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            route = {"/v1/completions": server.complete, RELOAD_ROUTE: server.reload}.get(self.path)
            if route is None:
                return self._send(404, {"error": f"no route {self.path}"})
            try:
                answer = route(body)
            except Exception as exc:  # noqa: BLE001 - a request this server cannot read: a 400 the engine quotes
                server.errors.append(f"{self.path}: {type(exc).__name__}: {exc}")
                return self._send(400, {"error": server.errors[-1]})
            self._send(200, answer)

        def _send(self, code: int, obj: dict[str, Any]) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    return Handler
