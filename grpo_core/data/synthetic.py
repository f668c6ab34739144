"""The built-in synthetic task: a prompt generator, a character tokenizer built locally (no hub)
and its rewards. The tiny preset starts near zero reward and learns it with GRPO in minutes on
two CPU cores, which makes it the embedded default for the demo and the learning test.

Task "reverse": the prompt is a short word over a small alphabet followed by '=', the answer is
the word reversed, then EOS. `cab=` -> `bac`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import string
from typing import Any, Sequence

import numpy as np

from grpo_core.config.data import SyntheticTask
from grpo_core.data.formats import completion_text
from grpo_core.errors import excerpt


class CharTokenizer:
    """One token per character, plus <eos>, which also pads (as in Qwen's base models: a model
    cannot hide an unfinished answer behind a padding token). Saves and loads as JSON."""

    SPECIALS = ("<eos>",)

    def __init__(self, chars: str = string.digits + string.ascii_lowercase + " +-*=:,.?#<>/"):
        if len(set(chars)) != len(chars):
            raise ValueError("tokenizer characters must be unique")
        self.chars = chars
        self.itos = list(self.SPECIALS) + list(chars)
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.pad_token_id = self.eos_token_id = 0

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as exc:
            raise ValueError(self.outside(exc.args[0], text)) from None

    def outside(self, char: str, text: str) -> str:
        """Why `text` cannot be encoded, and what to set instead: the built-in tokenizer is for the
        synthetic task (no byte fallback: its ids, and so the demo's hashes, stay as they are). The
        text is a data file's: the character, its position and 40 characters around it, no more."""
        at = text.find(char)
        return (
            f"character {char!r} at position {at} ({excerpt(text, 40, at)}) is not in the alphabet of the built-in "
            "character tokenizer "
            f"(model.tokenizer: char, {self.chars!r}), which is made for the synthetic task: set model.tokenizer to "
            "a Hugging Face tokenizer, e.g. --set model.tokenizer=Qwen/Qwen2.5-0.5B-Instruct (a Hub id) or "
            "model.tokenizer=path/to/folder (what save_pretrained writes: tokenizer.json, tokenizer_config.json), "
            "or start from a checkpoint with model.path, whose own tokenizer is used"
        )

    def decode(self, ids: Sequence[int]) -> str:
        # Special tokens decode to nothing, as HF's skip_special_tokens=True does.
        return "".join(self.itos[i] for i in ids if i >= len(self.SPECIALS) and i < len(self.itos))

    def save(self, path: str | pathlib.Path) -> None:
        pathlib.Path(path).write_text(json.dumps({"type": "char", "chars": self.chars}))

    def save_pretrained(self, folder: str) -> None:
        """The same tokenizer as Hugging Face files (a WordLevel model over single characters),
        so an exported model loads with AutoTokenizer and encodes text to the same ids.

        Written with `tokenizers` alone, as transformers' PreTrainedTokenizerFast.save_pretrained
        would write them: importing transformers for two small files took about a second of every
        export's worker (tests/test_tokenizers.py checks that transformers reads them back)."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # only an export needs them

        tk = Tokenizer(models.WordLevel(dict(self.stoi), unk_token=None))
        tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tk.decoder = decoders.Fuse()
        tk.add_special_tokens(list(self.SPECIALS))  # already in the vocabulary: marked special, ids kept
        out = pathlib.Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        tk.save(str(out / "tokenizer.json"))
        eos = self.itos[self.eos_token_id]
        special = {"eos_token": eos, "pad_token": eos}
        # the class both transformers 4 and 5 load a bare tokenizer.json with
        (out / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **special}, indent=2) + "\n"
        )
        (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | pathlib.Path) -> "CharTokenizer":
        return cls(json.loads(pathlib.Path(path).read_text())["chars"])


@dataclasses.dataclass(frozen=True)
class ReverseTask(SyntheticTask):
    """Prompts `w=` with w a word of `min_len..max_len` letters from `alphabet`; answer: w reversed
    (the fields and their checks: grpo_core.config.data.SyntheticTask).

    `sample(step, round, n)` is a pure function of its arguments and the seed, so a resumed run
    sees the same prompts; `split` keeps eval words out of training.
    """

    @classmethod
    def of(cls, settings: SyntheticTask) -> "ReverseTask":
        kind = CodebookTask if settings.task == "codebook" else cls
        return kind(**dataclasses.asdict(settings))

    def _row(self, rng: np.random.Generator) -> dict[str, Any]:
        n = int(rng.integers(self.min_len, self.max_len + 1))
        word = "".join(rng.choice(list(self.alphabet), size=n))
        return {"prompt": f"{word}=", "answer": word[::-1]}

    def sample(self, step: int, round_: int, n: int) -> list[dict[str, Any]]:
        rng = np.random.default_rng([self.seed, step, round_])
        return [self._row(rng) for _ in range(n)]

    def eval_rows(self, n: int) -> list[dict[str, Any]]:
        """A fixed evaluation set (its own seed stream, apart from every training step's)."""
        rng = np.random.default_rng([self.seed, 2**31 - 1])
        return [self._row(rng) for _ in range(n)]


@dataclasses.dataclass(frozen=True)
class CodebookTask(ReverseTask):
    """Prompts `w?`; answer: a code of three random digits drawn for the row, which nothing in the
    prompt determines (train and eval rows draw their own): only the `codebook` environment's tool,
    whose vault holds the row's code (grpo_core.agent.builtin.Codebook), can tell it."""

    def _row(self, rng: np.random.Generator) -> dict[str, Any]:
        n = int(rng.integers(self.min_len, self.max_len + 1))
        word = "".join(rng.choice(list(self.alphabet), size=n))
        return {"prompt": f"{word}?", "answer": "".join(str(d) for d in rng.integers(0, 10, size=3))}


def char_match(prompts: list[str], completions: list[str], answer: list[str], **_) -> list[float]:
    """Partial credit: characters in the right place / max(len(answer), len(completion))."""
    out = []
    for c, a in zip(map(completion_text, completions), answer):
        hits = sum(x == y for x, y in zip(c, a))
        out.append(hits / max(len(a), len(c), 1))
    return out


def exact_match(prompts: list[str], completions: list[str], answer: list[str], **_) -> list[float]:
    """1.0 when the completion is exactly the answer (after stripping spaces), else 0.0."""
    return [float(completion_text(c).strip() == a) for c, a in zip(completions, answer)]
