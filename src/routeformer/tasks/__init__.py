"""Every task a model is evaluated on, behind one contract (see `tasks.base.Task`):

    task = build_task("mqar", seq_len=64, pairs=4, vocab_size=64)
    inputs, labels = task.batch(64, torch.Generator().manual_seed(0), split="train")
    task.chance, task.baselines()   # the floor any model result is compared with

`list_tasks()` names them all with their options. Tasks know nothing of models.

Every task generator lives here with its shortcut baselines and hash splits (tasks/splits.py):
listops, recall (recall_sequences.py: the sequence formats), mqar, previous_token, lm, plus
meta-token injection (meta_tokens.py) and the structural regression toys (structural.py);
data/ holds only corpora, tokenizers, vocabularies, token caches and batching.
"""

from routeformer.tasks.base import IGNORE_INDEX, Task
from routeformer.tasks.registry import build_task, list_tasks, register_task
from routeformer.tasks.splits import SPLITS, split_of

# Importing the modules registers the built-in tasks.
from routeformer.tasks import listops, lm, mqar, previous_token, recall  # noqa: E402,F401  isort: skip

__all__ = ["IGNORE_INDEX", "SPLITS", "Task", "build_task", "list_tasks", "register_task", "split_of"]
