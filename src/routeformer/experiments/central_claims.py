"""The papers' central claims at length, each a named subset of `compare --long`.

`routeformer reproduce NAME` runs exactly the compare --long command that the claim's row in
docs/results/claims.md ("Central claims at the papers' settings") cites: the same budget
(`compare.budgets.LONG`: curriculum, model, budgets in keys, each task's mechanism recipes), the
mechanisms the claim compares, 3 seeds, 2 worker processes. Runs are cached under OUT/runs, so an
interrupted reproduction resumes after its finished runs, and a directory holding an earlier
compare --long's runs is read rather than re-trained. `--quick` trains a toy version of the same
tasks (two tiny stages, a 1-layer D=16 model, the embedded corpus) to check the plumbing.

Meta-Attention's Table 3 has its own experiment (`meta-attention-table3`): its setting is the
paper's char LM at T = 64, not the long budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from routeformer.experiments.registry import register_experiment


@dataclass(frozen=True)
class LongClaim:
    """A claim tested on compare --long's tasks: which tasks, which mechanisms against `full`."""
    description: str
    tasks: tuple[str, ...]
    mechanisms: tuple[str, ...]
    seeds: int = 3


CLAIMS = {
    "adsr-recall-4096": LongClaim(
        "ADSR (topk): learned top-k routing (K=64 keys) equals full attention on recall at T=4096 at a "
        "cheaper training step; compare --long --tasks mqar --mechanisms full topk", ("mqar",),
        ("full", "topk")),
    "mita-recall-4096": LongClaim(
        "MiTA: on par with full attention on recall at T=4096 (64-key blocks and experts); "
        "compare --long --tasks mqar --mechanisms full mita", ("mqar",), ("full", "mita")),
    "meta-tokens-code-lm": LongClaim(
        "meta-tokens: trained at T=4096 on the Python-source LM, evaluated at 2x and 4x the training "
        "context; compare --long --tasks code_lm --mechanisms full meta_tokens", ("code_lm",),
        ("full", "meta_tokens")),
    "expanding-at-length": LongClaim(
        "structural inference: expanding attention against full on the Python-source LM and on recall, "
        "both at T=4096; compare --long --tasks code_lm mqar --mechanisms full expanding",
        ("code_lm", "mqar"), ("full", "expanding")),
}


def quick_budget():
    """A toy long budget with the same task names (plumbing only: seconds, not results)."""
    from dataclasses import replace

    from routeformer.compare.budgets import LONG, curriculum_setup
    from routeformer.runner.setups import Stage
    from routeformer.train.on_task import ModelSpec
    from routeformer.train.schedule import Schedule

    schedule = Schedule(steps=2, batch_size=4, lr=1e-3, warmup_steps=1)
    toy = {"evals": 1, "validation_sequences": 8, "test_tokens": 256, "cost_batch": 2}
    return replace(
        LONG,
        tasks={"mqar": curriculum_setup({"seq_len": 32, "pairs": 4, "vocab_size": 16},
                                        (Stage({"seq_len": 16, "pairs": 2}, schedule), Stage({}, schedule)),
                                        **toy),
               "code_lm": curriculum_setup({"seq_len": 32}, (Stage({}, schedule),), task="lm", **toy)},
        spec=ModelSpec(dim=16, depth=1, heads=2, positions="rotary"), seeds=1, repeats=1)


def reproduce_long_claim(name: str, out_dir: Path, quick: bool) -> Path:
    """Run claim `name`'s compare --long subset into out_dir; returns report.md's path."""
    from routeformer.compare.budgets import LONG
    from routeformer.compare.run import run_compare

    claim = CLAIMS[name]
    command = (f"routeformer compare --long --tasks {' '.join(claim.tasks)} --mechanisms "
               f"{' '.join(claim.mechanisms)} --seeds {claim.seeds}")
    if quick:
        return run_compare(out_dir, mechanisms=list(claim.mechanisms), tasks=list(claim.tasks),
                           budget=quick_budget(), seeds=1, workers=1, corpus="pydoc",
                           command=f"routeformer reproduce {name} --quick")
    return run_compare(out_dir, mechanisms=list(claim.mechanisms), tasks=list(claim.tasks), budget=LONG,
                       seeds=claim.seeds, workers=2, command=command)


def _register(name: str, claim: LongClaim) -> None:
    register_experiment(name, claim.description)(
        lambda out_dir, quick, name=name: reproduce_long_claim(name, Path(out_dir), quick))


for _name, _claim in CLAIMS.items():
    _register(_name, _claim)
