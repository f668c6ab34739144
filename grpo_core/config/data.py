"""The `data` section: where the prompts come from and how they become token ids, and the
prepared data's hash. Data only: grpo_core.data.prepare reads and writes the rows."""

from __future__ import annotations

import dataclasses
import enum
import typing

from grpo_core.config.fields import Section, Trust, check, config_hash, field, placeholders, section
from grpo_core.errors import ConfigError


class DataFormat(enum.Enum):
    AUTO = "auto"
    PLAIN = "plain"
    GSM8K = "gsm8k"
    VERL = "verl"


SYNTHETIC_TASKS = ("reverse", "codebook")


@dataclasses.dataclass(frozen=True)
class SyntheticTask:
    """The synthetic task's settings (data.synthetic): words of `min_len..max_len` letters from
    `alphabet`; grpo_core.data.synthetic draws the prompts: `reverse` (the word reversed) or
    `codebook` (a code of random digits that only the codebook environment's tool tells:
    grpo demo --task tools)."""

    alphabet: str = "abcde"
    min_len: int = 3
    max_len: int = 3
    seed: int = 0
    task: str = "reverse"

    def __post_init__(self):
        if self.task not in SYNTHETIC_TASKS:
            raise ConfigError(f"task.task must be one of {', '.join(SYNTHETIC_TASKS)}, got {self.task!r}")
        if not (1 <= self.min_len <= self.max_len):
            raise ConfigError(
                f"task.min_len/max_len must satisfy 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}"
            )
        if len(self.alphabet) < 2:
            raise ConfigError(f"task.alphabet needs at least 2 letters, got {self.alphabet!r}")


FILE_FORMATS = (".jsonl", ".json", ".parquet", ".csv")


@section(path="data")
class DataConfig(Section):
    """Where the prompts come from and how they become token ids."""

    # "synthetic", a .jsonl/.json/.parquet/.csv path or URL, or a HF dataset id/folder
    source: str = field(
        "synthetic",
        doc="'synthetic', a .jsonl/.json/.parquet/.csv path or gs:// URL, or a Hugging Face dataset id or folder",
        min_length=1,
        trust=Trust.READS,
    )
    # HF config name
    subset: str | None = field(None, doc="Hugging Face dataset config (subset) name", trust=Trust.SAFE)
    split: str = field("train", doc="Split to train on", trust=Trust.SAFE)
    # eval rows from this split instead of a held-out fraction
    eval_split: str | None = field(
        None, doc="Split to evaluate on; empty: hold out data.eval_fraction of the training rows", trust=Trust.SAFE
    )
    # a file of evaluation rows (e.g. a benchmark's test split as .jsonl / .parquet)
    eval_source: str | None = field(
        None,
        doc="A .jsonl/.json/.parquet/.csv file (path or gs:// URL) to evaluate on, read like data.source; "
        "empty: data.eval_split, or a held-out fraction",
        trust=Trust.READS,
    )
    # auto, plain, gsm8k, verl: see grpo_core.data.formats
    format: DataFormat = field(
        DataFormat.AUTO,
        doc=(
            "How rows are read: gsm8k (question, answer ending in '#### 42'), verl (prompt messages, "
            "reward_model.ground_truth), plain, or auto (detect gsm8k/verl from the first row)"
        ),
    )
    prompt_column: str = field("prompt", doc="Column holding the prompt", trust=Trust.SAFE)
    # source column -> the name rewards see; applied first
    rename: dict | None = field(
        None, doc="Column renames applied first: {source column: name the rewards see}", trust=Trust.SAFE
    )
    # str.format over the row's columns, e.g. "Q: {question}\nA:"
    template: str | None = field(
        None, doc="Prompt template over the row's columns, e.g. 'Q: {question}\\nA:'", trust=Trust.SAFE
    )
    # through the tokenizer's chat template
    chat: bool = field(False, doc="Render prompts with the tokenizer's chat template")
    system_prompt: str | None = field(None, doc="System message for chat prompts", trust=Trust.SAFE)
    # longer prompts are dropped (and counted)
    max_prompt_tokens: int = field(256, doc="Prompts longer than this are dropped (and counted)", ge=1, api_max=32_768)
    max_rows: int | None = field(None, doc="Use at most this many rows", ge=2)
    eval_fraction: float = field(0.1, doc="Fraction of rows held out for evaluation", ge=0, le=0.9)
    # cap on the eval set; "all": every row of eval_split / eval_source (a whole benchmark)
    eval_rows: int | typing.Literal["all"] = field(
        128,
        doc="At most this many evaluation rows (a seeded sample of a longer split); all: every row",
        ge=1,
        api_max=100_000,
    )
    # shuffles before the split, and the order prompts are drawn in
    seed: int = field(0, doc="Shuffle seed for the split and the prompt order", ge=0)
    # ReverseTask fields: alphabet, min_len, max_len, seed
    synthetic: dict | None = field(None, doc="The synthetic task: alphabet, min_len, max_len, seed", trust=Trust.SAFE)
    synthetic_rows: int = field(4096, doc="Training rows generated for the synthetic task", ge=1, api_max=1_000_000)

    def validate(self) -> None:
        check(
            self.rename is None
            or (
                isinstance(self.rename, dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in self.rename.items())
            ),
            f"data.rename must map column names to names, got {self.rename!r}",
        )
        check(
            self.synthetic is None or isinstance(self.synthetic, dict),
            f"data.synthetic must be a mapping of task fields, got {self.synthetic!r}",
        )
        if self.is_file:
            check(
                self.eval_split is None,
                f"data.eval_split applies to Hugging Face datasets; {self.source} is one file: evaluate on another "
                "file with data.eval_source=path/to/test.jsonl, or make data.source a folder of split files "
                "(train-*.parquet, test-*.parquet, as on the Hub) with data.eval_split=test, or hold out "
                "data.eval_fraction of it",
            )
        check(
            self.eval_source is None or self.eval_split is None,
            "set data.eval_source (a file) or data.eval_split (a split of data.source), not both",
        )
        check(
            self.eval_source is None or self.eval_source.lower().endswith(FILE_FORMATS),
            f"data.eval_source must be a {'/'.join(FILE_FORMATS)} file, got {self.eval_source!r}",
        )
        check(
            self.eval_rows != "all" or self.eval_source is not None or self.eval_split is not None,
            "data.eval_rows=all takes every row of data.eval_split or data.eval_source; without either, the eval "
            "rows are a held-out data.eval_fraction of data.source: give a number",
        )
        if self.source == "synthetic":
            check(
                self.format in (DataFormat.AUTO, DataFormat.PLAIN),
                f"data.format={self.format.value} applies to a dataset; the synthetic task has its own rows",
            )
            self.task()  # validate now
        if self.template is not None:
            _check_template(self.template)

    @property
    def is_file(self) -> bool:
        return self.source.lower().endswith(FILE_FORMATS)

    def task(self) -> SyntheticTask:
        """The synthetic task's settings, validated (grpo_core.data.synthetic.ReverseTask draws its rows)."""
        known = [f.name for f in dataclasses.fields(SyntheticTask)]
        unknown = sorted(set(self.synthetic or {}) - set(known))
        if unknown:  # said as a field would be, not as ReverseTask.__init__'s TypeError
            raise ConfigError(f"data.synthetic: unknown key(s) {unknown}; known: {known}")
        try:
            return SyntheticTask(**(self.synthetic or {}))
        except TypeError as exc:
            raise ConfigError(f"data.synthetic: {exc}") from None
        except ConfigError as exc:
            raise ConfigError(f"data.synthetic: {exc}") from None


def _check_template(template: str) -> None:
    """Only plain {column} placeholders (fields.placeholders): no positional '{}', no '{a.b}' or
    '{a[0]}', no format spec or conversion."""
    placeholders(template, "data.template", like="column names like {question}")


# Fields added after runs existed, left out of the hash at their default so that those runs
# keep their data hash (and so their training hash and checkpoints).
_HASH_OMITS_DEFAULT = {"format": DataFormat.AUTO.value, "eval_source": None}


def data_hash(cfg: DataConfig, tokenizer_id: str, versions: dict[str, str] | None = None) -> str:
    """The prepared data's key: the data section, the tokenizer, and the versions of the sources
    (grpo_core.store.versions; left out where none is known, so older keys hold)."""
    fields = {k: v for k, v in cfg.to_dict().items() if _HASH_OMITS_DEFAULT.get(k, object()) != v}
    return config_hash({"data": fields, "tokenizer": tokenizer_id, **({"versions": versions} if versions else {})})
