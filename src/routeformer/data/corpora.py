"""Text corpora for language modelling, by spec string or by local path.

| spec | what |
|---|---|
| `pydoc` | the embedded default: CPython's own help text (`pydoc_data.topics`), ~465 KB, split 90/10 |
| `text:PATH` | any UTF-8 file, split 90/10 (`data.path` does the same and takes folders too) |
| `tinyshakespeare` or `tinyshakespeare:PATH` | Tiny Shakespeare, split 90/10 |
| `wikitext2` or `wikitext2:DIR` | WikiText-2, the raw text (`wikitext-2-raw-v1`, as LM papers report) |
| `pystdlib` or `pystdlib:DIR` | Python 3.11 stdlib source, a document per file: `{train,valid,test}.jsonl` |

`load_path(PATH)` (the training config's `data.path`, which replaces `data.corpus`) reads a file
(split 90/10) or a folder: one with `train`/`valid` splits (`train.txt` + `valid.txt`, or
WikiText's `wiki.train.raw` + `wiki.valid.raw`) trains on the first and evaluates on the second;
any other folder is every `.txt`, `.md`, `.raw` and `.text` file under it, in path order, joined
and split 90/10.

Where a corpus is looked up without a path, routeformer searches `$ROUTEFORMER_DATA_DIR`, then
`./data` and `../shared/data`. For `wikitext2` it looks for `wikitext-2-raw/` (the raw release);
failing that, a local `wikitext-2/` folder of the tokenised release (`wikitext-2-v1`, rare words
replaced by `<unk>`, as ../shared/data holds) is used and the corpus name says "tokenised". With
no local copy, the Hugging Face `datasets` loader fetches `wikitext-2-raw-v1` (needs
`pip install 'routeformer[datasets]'`). Without network that is one ValueError line within a
few seconds saying how to supply the data locally (`HF_HUB_OFFLINE=1` or `HF_DATASETS_OFFLINE=1`
make it immediate). A WikiText directory needs a validation split; without a training split (as in
../shared/data, ~1 MB) it trains on the validation split and evaluates on the test split — the
corpus name says which.

`pystdlib` is looked up as `python-stdlib/` in the same folders; nothing is downloaded (a missing
copy is a ValueError naming where it looked and how to pass one). Its `Corpus` keeps the document
boundaries: `documents` maps "train" / "validation" / "test" to the files' texts (in file order)
and `document_paths` to their paths; `train`, `val` and `test` are those texts joined back to back
with nothing between them (every file ends in a newline), so document i of a split starts at the
sum of the lengths before it. Corpora with a `test` text keep it as their test split (`lm` then
evaluates on `val` and `test` as they are, instead of halving `val`).
"""

from __future__ import annotations

import json
import os
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

SPLIT_FRACTION = 0.9
CORPORA = ("pydoc", "text:PATH", "tinyshakespeare[:PATH]", "wikitext2[:DIR]", "pystdlib[:DIR]")
PYSTDLIB_FOLDER = "python-stdlib"
PYSTDLIB_SPLITS = (("train", "train.jsonl"), ("validation", "valid.jsonl"), ("test", "test.jsonl"))
TEXT_SUFFIXES = (".txt", ".md", ".raw", ".text")
HUB_HOST, HUB_PORT = "huggingface.co", 443
NETWORK_PROBE_SECONDS = 3.0


@dataclass
class Corpus:
    """A corpus's text per split. `test` is None where the corpus has no test split of its own (the
    LM task then halves `val`); `documents` / `document_paths` are None where it is one stream."""
    name: str
    train: str
    val: str
    test: str | None = None
    documents: dict[str, list[str]] | None = field(default=None, repr=False)
    document_paths: dict[str, list[str]] | None = field(default=None, repr=False)


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
        path = Path(argument) if argument else find_data("tinyshakespeare/input.txt")
        if path is None:
            raise ValueError(
                "corpus 'tinyshakespeare' not found: pass tinyshakespeare:PATH or set "
                "ROUTEFORMER_DATA_DIR to a folder holding tinyshakespeare/input.txt"
            )
        return _split("tinyshakespeare", _read(path))
    if kind == "wikitext2":
        directory = Path(argument) if argument else find_data("wikitext-2-raw") or find_data("wikitext-2")
        if directory is not None:
            return _wikitext_from_directory(directory)
        return _wikitext_from_hub()
    if kind == "pystdlib":
        return load_pystdlib(Path(argument) if argument else None)
    raise ValueError(f"unknown corpus {spec!r}; valid: {', '.join(CORPORA)}")


def load_path(path: str | Path, option: str = "data.path") -> Corpus:
    """The corpus in a local file or folder (see the module docstring): `data.path`. Raises
    ValueError, naming `option` (the setting that gave the path), for a path that is neither a file
    nor a folder and for a folder without text files."""
    path = Path(path)
    if path.is_file():
        return _split(f"path:{path}", _read(path))
    if not path.is_dir():
        raise ValueError(f"{option} {str(path)!r} is neither a file nor a folder")
    for train_name, valid_name in (("train.txt", "valid.txt"), ("wiki.train.raw", "wiki.valid.raw"),
                                   ("wiki.train.tokens", "wiki.valid.tokens")):
        if (path / train_name).is_file() and (path / valid_name).is_file():
            return Corpus(f"path:{path} ({train_name} / {valid_name})", _read(path / train_name),
                          _read(path / valid_name))
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise ValueError(f"{option} {str(path)!r} holds no text files ({', '.join(TEXT_SUFFIXES)})")
    return _split(f"path:{path} ({len(files)} files)", "\n".join(_read(file) for file in files))


def load_data(corpus: str, path: str | None = None) -> Corpus:
    """A training config's text: `data.path` when set, else the `data.corpus` spec."""
    return load_path(path) if path else load_corpus(corpus)


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


def find_data(relative: str) -> Path | None:
    """The first data folder (data_dirs) holding `relative`, as a path; None where none does."""
    for directory in data_dirs():
        if (directory / relative).exists():
            return directory / relative
    return None


def load_pystdlib(directory: Path | None = None) -> Corpus:
    """The Python standard-library corpus in `directory` (default: `python-stdlib/` in the data
    folders): {train,valid,test}.jsonl, one JSON object with `path` and `text` per line, as documents."""
    if directory is None:
        directory = find_data(f"{PYSTDLIB_FOLDER}/train.jsonl")
        if directory is None:
            where = ", ".join(str(d / PYSTDLIB_FOLDER) for d in data_dirs())
            raise ValueError(
                f"corpus 'pystdlib' not found (looked for {PYSTDLIB_FOLDER}/train.jsonl in {where}); "
                "pass pystdlib:DIR (a folder holding train.jsonl, valid.jsonl and test.jsonl) or set "
                f"ROUTEFORMER_DATA_DIR to a folder holding {PYSTDLIB_FOLDER}/; nothing is downloaded")
        directory = directory.parent
    documents: dict[str, list[str]] = {}
    paths: dict[str, list[str]] = {}
    for split, file_name in PYSTDLIB_SPLITS:
        path = directory / file_name
        if not path.is_file():
            raise ValueError(f"corpus 'pystdlib': {str(path)!r} does not exist; pystdlib:DIR needs "
                             "DIR/train.jsonl, DIR/valid.jsonl and DIR/test.jsonl")
        documents[split], paths[split] = [], []
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    text, name = record["text"], record["path"]
                except (json.JSONDecodeError, KeyError, TypeError) as error:
                    raise ValueError(f"corpus 'pystdlib': {str(path)!r} line {number} is not a JSON "
                                     f"object with 'path' and 'text' ({error})") from None
                documents[split].append(text)
                paths[split].append(name)
        if not documents[split]:
            raise ValueError(f"corpus 'pystdlib': {str(path)!r} holds no documents")
    joined = {split: "".join(texts) for split, texts in documents.items()}
    return Corpus("pystdlib (train / valid / test files)", joined["train"], joined["validation"],
                  joined["test"], documents=documents, document_paths=paths)


def _wikitext_from_directory(directory: Path) -> Corpus:
    """WikiText splits under either naming: {train,valid,test}.txt or the release's wiki.*.raw/.tokens."""
    def split(name: str) -> Path | None:
        for candidate in (f"{name}.txt", f"wiki.{name}.raw", f"wiki.{name}.tokens"):
            if (directory / candidate).is_file():
                return directory / candidate
        return None

    valid, test, train = split("valid"), split("test"), split("train")
    if valid is None:
        raise ValueError(f"WikiText-2 directory {str(directory)!r} has no valid.txt (or wiki.valid.raw)")
    raw = directory.name != "wikitext-2" and not valid.name.endswith(".tokens")
    name = "wikitext2" if raw else "wikitext2 tokenised release"
    if train is not None:
        return Corpus(f"{name} (train / valid)", _read(train), _read(valid))
    if test is None:
        raise ValueError(f"WikiText-2 directory {str(directory)!r} has neither a train nor a test split")
    return Corpus(f"{name} (trained on valid, evaluated on test)", _read(valid), _read(test))


_HOW_TO_SUPPLY = ("download wikitext-2-raw-v1 where there is network (e.g. the parquet or wiki.*.raw "
                  "files of the Hugging Face dataset 'wikitext') and pass --data.path DIR, or put it in "
                  "$ROUTEFORMER_DATA_DIR/wikitext-2-raw/ (train.txt, valid.txt, test.txt or wiki.*.raw)")


def _wikitext_from_hub() -> Corpus:
    where = ", ".join(str(d) for d in data_dirs())
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0") or \
            os.environ.get("HF_DATASETS_OFFLINE", "") not in ("", "0"):
        raise ValueError(f"corpus 'wikitext2': no local copy (looked in {where}) and offline mode is set; "
                         + _HOW_TO_SUPPLY)
    if not hub_reachable():
        raise ValueError(f"corpus 'wikitext2': no local copy (looked in {where}) and {HUB_HOST} is "
                         f"unreachable; " + _HOW_TO_SUPPLY)
    try:
        import datasets
    except ImportError:
        raise ValueError(f"corpus 'wikitext2': no local copy (looked in {where}) and the `datasets` "
                         "package is not installed: pip install 'routeformer[datasets]', or "
                         + _HOW_TO_SUPPLY) from None
    splits = datasets.load_dataset("wikitext", "wikitext-2-raw-v1")
    join = lambda split: "".join(splits[split]["text"])  # noqa: E731 - lines keep their newlines
    return Corpus("wikitext2 (train / validation)", join("train"), join("validation"))


def hub_reachable(host: str | None = None, port: int | None = None,
                  timeout: float = NETWORK_PROBE_SECONDS) -> bool:
    """Whether a TCP connection to the Hugging Face hub opens within `timeout` seconds. Name lookup
    cannot be given a timeout, so the probe runs in a daemon thread that is abandoned when late."""
    host, port = host or HUB_HOST, port or HUB_PORT
    result: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])
