"""Run configuration: model + data + training, loaded from YAML with `--key value` overrides.

A file and the overrides spell every section flat (`train.warmup_steps`, `--lr 3e-4`); in memory the
`train` section keeps its steps, batch size, learning rate, warm-up, cosine floor and clipping in one
`Schedule` (train/schedule.py), the type every training loop reads. `RunConfig.to_dict` and
`from_dict` convert between the two (config files hold the flat layout). `routeformer train`
trains a RunConfig as the task-lm run of it (runner/lm_config.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from routeformer.models.config import ModelConfig
from routeformer.ops._checks import check_positive
from routeformer.train.config_types import (
    coerce_attention_options,
    coerce_section,
    field_types,
    parse_override,
)
from routeformer.train.schedule import Schedule

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class DataConfig:
    corpus: str = "pydoc"  # see routeformer.data.corpora
    # A local text file or folder to train on; when set it replaces `corpus` (data/corpora.py).
    path: str | None = None
    # "char" (one id per character) or a tokenizers BPE model: a tokenizer.json or a Hugging Face
    # tokenizer directory (data/tokenizers.py).
    tokenizer: str = "char"
    seq_len: int = 128
    # Meta-tokens: the fraction of each window's slots that hold an injected `_PAUSE_` (training and
    # evaluation; no loss on predicting one). 0 = none. See tasks/meta_tokens.py.
    meta_density: float = 0.0
    # Packed documents: a document is a paragraph (text up to a blank line); training windows carry
    # document ids, no attention crosses a paragraph boundary and no loss is taken across one
    # (data/documents.py). Evaluation stays on plain windows. Off by default.
    pack_documents: bool = False


@dataclass
class TrainConfig:
    # steps, batch_size, lr, warmup_steps, min_lr_ratio (the cosine decays to lr · min_lr_ratio) and
    # grad_clip (0 disables clipping): keys of `train` in files and overrides (`train_keys`).
    schedule: Schedule = Schedule(steps=600, batch_size=32, lr=3e-3, warmup_steps=100)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    eval_every: int = 200
    eval_tokens: int = 65536  # validation tokens per periodic evaluation
    final_eval_tokens: int | None = None  # validation tokens of the final evaluation (None: all)
    checkpoint_every: int = 100
    log_every: int = 50
    seed: int = 0
    # "cpu", "cuda" (cuda:LOCAL_RANK under torchrun) or "auto". Under torchrun, batch_size is the
    # global batch, split across the processes (train/distributed.py).
    device: str = "cpu"
    # Attention stats to log (averaged over the layers that report them), e.g. ["kl", "projected_cost"].
    log_stats: list[str] = field(default_factory=list)
    # A step whose loss or gradient is NaN/inf is skipped; this many in a row stop the run (guard.py).
    max_nonfinite_steps: int = 10
    keep_checkpoints: int = 2  # the newest K training checkpoints stay in out_dir (record.train0.pt, .1.pt)
    # "bf16": forward under torch.autocast in bfloat16 (CPU or CUDA); "fp16": float16 autocast with a
    # gradient scaler (CUDA only). Weights, optimizer and evaluation stay fp32.
    precision: str = "fp32"
    # Where metrics go besides metrics.jsonl (always written): "jsonl" (nowhere else) or
    # "tensorboard" (event files in out_dir/tensorboard; pip install 'routeformer[tensorboard]').
    logger: str = "jsonl"


LOGGERS = ("jsonl", "tensorboard")


@dataclass
class RunConfig:
    """A training run: the model, its data, the training settings and the run directory; built by
    `load_config` from a YAML file and `--key value` overrides (`routeformer train --help` lists them)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    out_dir: str = "runs/default"

    def __post_init__(self) -> None:
        train = train_keys(self.train)
        for name in ("steps", "batch_size", "eval_every", "eval_tokens", "checkpoint_every", "log_every",
                     "max_nonfinite_steps", "keep_checkpoints"):
            check_positive(f"train.{name}", train[name])
        check_positive("data.seq_len", self.data.seq_len)
        if self.model.causal is not True:  # a language model must not read the characters it predicts
            raise ValueError(f"model.causal: routeformer train trains a causal language model; "
                             f"got {self.model.causal!r}")
        from routeformer.tasks.meta_tokens import check_density

        check_density("data.meta_density", self.data.meta_density)
        if self.model.meta_token_id is not None and self.data.meta_density == 0:
            raise ValueError("model.meta_token_id: routeformer train sets it to the tokeniser's pause id "
                             "where data.meta_density > 0; without meta-tokens it would mark a real token "
                             "as one; "
                             f"got {self.model.meta_token_id!r}")
        if self.data.pack_documents and self.data.meta_density > 0:
            raise ValueError("data.pack_documents with data.meta_density > 0 is not supported; "
                             "use one of them")
        if self.train.final_eval_tokens is not None:
            check_positive("train.final_eval_tokens", self.train.final_eval_tokens)
        if not train["lr"] > 0:
            raise ValueError(f"train.lr must be > 0; got {train['lr']!r}")
        if not 0 <= train["min_lr_ratio"] <= 1:
            raise ValueError(f"train.min_lr_ratio must be in [0, 1]; got {train['min_lr_ratio']!r}")
        if self.train.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"train.device must be 'cpu', 'cuda' or 'auto'; got {self.train.device!r}")
        if self.train.logger not in LOGGERS:
            raise ValueError(f"train.logger must be one of {LOGGERS}; got {self.train.logger!r}")
        if not self.data.tokenizer:
            raise ValueError("data.tokenizer must be 'char' or a path to a tokenizer.json or its folder")
        if self.train.precision not in PRECISIONS:
            raise ValueError(f"train.precision must be one of {PRECISIONS}; got {self.train.precision!r}")
        for name in ("warmup_steps", "grad_clip", "weight_decay"):
            if train[name] < 0:
                raise ValueError(f"train.{name} must be >= 0; got {train[name]!r}")
        for name in ("beta1", "beta2"):
            if not 0 <= train[name] < 1:
                raise ValueError(f"train.{name} must be in [0, 1); got {train[name]!r}")

    def to_dict(self) -> dict[str, Any]:
        """Plain values in a config file's layout (what config.yaml and checkpoints hold)."""
        return {**asdict(self), "train": train_keys(self.train)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunConfig:
        """Build from plain values (a YAML file, a checkpoint), each converted to its field's type."""
        if not isinstance(values, dict):
            raise ValueError(f"a run config must be a mapping of sections; got {values!r}")
        values = dict(values)
        unknown = sorted(set(values) - set(SECTIONS) - {"out_dir"})
        if unknown:
            raise ValueError(f"unknown config key(s) {unknown}; valid: {sorted(SECTIONS) + ['out_dir']}")
        built = {}
        for name, section in SECTIONS.items():
            part = coerce_section(name, section_types(name), values.get(name) or {})
            if name == "model":
                if "attention_options" in part:
                    part["attention_options"] = coerce_attention_options(part["attention_options"])
                built[name] = ModelConfig.from_dict(part)
                continue
            valid = section_types(name)
            bad = sorted(set(part) - set(valid))
            if bad:
                raise ValueError(f"unknown {name} config key(s) {bad}; valid: {sorted(valid)}")
            built[name] = _train_config(part) if section is TrainConfig else section(**part)
        out_dir = values.get("out_dir", "runs/default")
        if not isinstance(out_dir, (str, int, float)) or isinstance(out_dir, bool) or out_dir == "":
            raise ValueError(f"out_dir must be a directory path; got {out_dir!r}")
        return cls(**built, out_dir=str(out_dir))


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}
_SCHEDULE_KEYS = tuple(f.name for f in fields(Schedule))


def train_keys(train: TrainConfig) -> dict[str, Any]:
    """The `train` section as a file spells it: the schedule's fields, then the others."""
    values = asdict(train)
    schedule = values.pop("schedule")
    return {**schedule, **values}


def _train_config(values: dict[str, Any]) -> TrainConfig:
    """A TrainConfig from flat `train` keys (those not given keep their defaults)."""
    scheduled = {key: value for key, value in values.items() if key in _SCHEDULE_KEYS}
    rest = {key: value for key, value in values.items() if key not in _SCHEDULE_KEYS}
    return TrainConfig(replace(TrainConfig().schedule, **scheduled), **rest)


def section_types(name: str) -> dict[str, Any]:
    """{key: type} of the section `name` as files and overrides spell it (`train`: the schedule's
    fields beside its own)."""
    types = field_types(SECTIONS[name])
    if name == "train":
        del types["schedule"]
        types = {**field_types(Schedule), **types}
    return types


def describe_keys() -> str:
    """Every config key as `--section.key TYPE (default VALUE)`, one per line (`train --help`)."""
    defaults = RunConfig().to_dict()
    lines = []
    for section in SECTIONS:
        for key, annotation in section_types(section).items():
            lines.append(f"  --{section}.{key} {_type_name(annotation)} (default {defaults[section][key]!r})")
    lines.append(f"  --out_dir str (default {defaults['out_dir']!r})")
    return "\n".join(lines)


def _type_name(annotation: Any) -> str:
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (or the defaults) and apply `--key value` overrides.

    Keys are dotted (`model.dim`, `train.steps`) or, where unambiguous, bare (`steps`).
    Values are parsed as YAML (`true`, `[local, full]`, `{local: {window: 64}}`) and then typed by
    the field they set (config_types.py): `--lr 3e-4` is the number, `--out_dir 010` the text.
    """
    values: dict[str, Any] = RunConfig().to_dict()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            raise ValueError(f"config file {str(path)!r}{where}: not valid YAML "
                             f"({getattr(error, 'problem', None) or error})") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {str(path)!r} must hold a mapping")
        for key, value in loaded.items():
            if isinstance(value, dict) and isinstance(values.get(key), dict):
                values[key] = {**values[key], **value}
            else:
                values[key] = value
    for key, raw in parse_overrides(overrides or []):
        _set(values, key, raw)
    return RunConfig.from_dict(values)


def parse_overrides(arguments: list[str]) -> list[tuple[str, str]]:
    """['--model.dim', '64', '--steps=10'] -> [('model.dim', '64'), ('steps', '10')] (raw text: the
    field a key names decides how its value is read)."""
    pairs, i = [], 0
    while i < len(arguments):
        argument = arguments[i]
        if not argument.startswith("--"):
            raise ValueError(f"expected an override like --key value; got {argument!r}")
        key = argument[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(arguments):
                raise ValueError(f"override --{key} needs a value")
            raw = arguments[i + 1]
            i += 2
        if not key:
            raise ValueError(f"expected an override like --key value; got {argument!r}")
        pairs.append((key.replace("-", "_"), raw))
    return pairs


def _set(values: dict[str, Any], key: str, raw: str) -> None:
    """Apply the override `--key raw`, reading `raw` as the field it sets is typed."""
    if "." not in key:
        if key in values and not isinstance(values[key], dict):
            values[key] = raw  # out_dir: a path, kept as typed
            return
        owners = [name for name, part in values.items() if isinstance(part, dict) and key in part]
        if len(owners) != 1:
            raise ValueError(
                f"unknown config key {key!r}; keys are model.*, data.*, train.* or out_dir "
                "(bare names where unambiguous)" if not owners
                else f"config key {key!r} is ambiguous; use one of {[f'{o}.{key}' for o in owners]}"
            )
        key = f"{owners[0]}.{key}"
    section, leaf = key.split(".", 1)
    if section not in SECTIONS or not isinstance(values.get(section), dict):
        raise ValueError(f"unknown config section {section!r} in --{key}; valid: model, data, train")
    annotation = section_types(section).get(leaf)
    if annotation is None:  # RunConfig.from_dict names the valid keys
        values[section][leaf] = raw
        return
    values[section][leaf] = parse_override(key, raw, annotation)
