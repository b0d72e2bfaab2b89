"""Character-level corpora, by spec string.

| spec | what |
|---|---|
| `pydoc` | the embedded default: CPython's own help text (`pydoc_data.topics`), ~465 KB, split 90/10 |
| `text:PATH` | any UTF-8 file, split 90/10 |
| `tinyshakespeare` or `tinyshakespeare:PATH` | Tiny Shakespeare, split 90/10 |
| `wikitext2` or `wikitext2:DIR` | WikiText-2 (tokenised release, `wikitext-2-v1`) |

Where a corpus is looked up without a path, routeformer searches `$ROUTEFORMER_DATA_DIR`, then
`./data` and `../shared/data`. `wikitext2` with no local copy uses the Hugging Face `datasets`
loader (needs `pip install routeformer[datasets]` and a network). A local WikiText-2 directory
needs `valid.txt` and `test.txt`; with `train.txt` the model trains on it and evaluates on
`valid.txt`, without it (as in ../shared/data, ~1 MB) it trains on `valid.txt` and evaluates on
`test.txt` — the corpus name says which.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SPLIT_FRACTION = 0.9
CORPORA = ("pydoc", "text:PATH", "tinyshakespeare[:PATH]", "wikitext2[:DIR]")


@dataclass
class Corpus:
    name: str
    train: str
    val: str


def load_corpus(spec: str) -> Corpus:
    """Load the corpus named by `spec` (see the module docstring)."""
    kind, _, argument = spec.partition(":")
    if kind == "pydoc":
        return _split("pydoc", _pydoc_text())
    if kind == "text":
        if not argument:
            raise ValueError("corpus 'text:PATH' needs a path, e.g. text:notes.txt")
        return _split(f"text:{argument}", _read(Path(argument)))
    if kind == "tinyshakespeare":
        path = Path(argument) if argument else _find("tinyshakespeare/input.txt")
        if path is None:
            raise ValueError(
                "corpus 'tinyshakespeare' not found: pass tinyshakespeare:PATH or set "
                "ROUTEFORMER_DATA_DIR to a folder holding tinyshakespeare/input.txt"
            )
        return _split("tinyshakespeare", _read(path))
    if kind == "wikitext2":
        directory = Path(argument) if argument else _find("wikitext-2")
        if directory is not None:
            return _wikitext_from_directory(directory)
        return _wikitext_from_hub()
    raise ValueError(f"unknown corpus {spec!r}; valid: {', '.join(CORPORA)}")


def _pydoc_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def _split(name: str, text: str) -> Corpus:
    if len(text) < 100:
        raise ValueError(f"corpus {name!r} has only {len(text)} characters; need at least 100")
    cut = int(len(text) * SPLIT_FRACTION)
    return Corpus(name, text[:cut], text[cut:])


def _read(path: Path) -> str:
    if not path.is_file():
        raise ValueError(f"corpus file {str(path)!r} does not exist")
    return path.read_text(encoding="utf-8")


def data_dirs() -> list[Path]:
    """Where corpora are looked up when no path is given, in order."""
    dirs = [Path(os.environ["ROUTEFORMER_DATA_DIR"])] if os.environ.get("ROUTEFORMER_DATA_DIR") else []
    return dirs + [Path("data"), Path("../shared/data")]


def _find(relative: str) -> Path | None:
    for directory in data_dirs():
        if (directory / relative).exists():
            return directory / relative
    return None


def _wikitext_from_directory(directory: Path) -> Corpus:
    valid, test, train = (directory / f"{split}.txt" for split in ("valid", "test", "train"))
    if not valid.is_file():
        raise ValueError(f"WikiText-2 directory {str(directory)!r} has no valid.txt")
    if train.is_file():
        return Corpus("wikitext2 (train / valid)", _read(train), _read(valid))
    if not test.is_file():
        raise ValueError(f"WikiText-2 directory {str(directory)!r} has neither train.txt nor test.txt")
    return Corpus("wikitext2 (trained on valid, evaluated on test)", _read(valid), _read(test))


def _wikitext_from_hub() -> Corpus:
    try:
        import datasets
    except ImportError as error:
        raise ValueError(
            "no local WikiText-2 found and the `datasets` package is not installed: "
            "pip install 'routeformer[datasets]', or pass wikitext2:DIR"
        ) from error
    splits = datasets.load_dataset("wikitext", "wikitext-2-v1")
    join = lambda split: "".join(splits[split]["text"])  # noqa: E731 - lines keep their newlines
    return Corpus("wikitext2 (train / validation)", join("train"), join("validation"))
