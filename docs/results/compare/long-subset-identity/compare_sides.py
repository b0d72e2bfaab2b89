"""compare --long subset before vs after: the training records (quality, validation, tests at T/2T/4T)."""
import json
from pathlib import Path
keys = ("quality", "validation", "tests", "parameters", "task_options", "options", "stages")
for job in ("long-mqar_512-full-seed0", "long-mqar_512-topk-seed0"):
    b, a = (json.loads(Path(f"/work/main/runs/ls-{s}/runs/{job}.json").read_text()) for s in ("before", "after"))
    strip = lambda r: {k: ({L: {m: v for m, v in t.items() if m != "seconds"} for L, t in r[k].items()}
                           if k == "tests" else r[k]) for k in keys if k in r}
    same = strip(b) == strip(a)
    print(job, "identical" if same else "DIFFERENT", {L: t.get("accuracy") for L, t in b["tests"].items()},
          "fields before/after equal:", sorted(b) == sorted(a))
