"""docs/integrations.md: every ```python block runs as written, in order, in one namespace."""

import re
from pathlib import Path

from tests.extras import require

require("transformers", "hf")

DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def test_the_examples_run_as_written(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)  # the examples save into the working directory
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(DOCS), "exec"), namespace)
    assert namespace["tokens"].shape == (1, 13)
    assert (tmp_path / "gpt2-local" / "model.safetensors").exists()
