"""compare --quick before vs after: every seed's quality, bit for bit (12 mechanism x task means, 36 runs)."""
import json
sides = {s: json.load(open(f"/work/main/runs/cq-{s}/result.json"))["tasks"] for s in ("before", "after")}
same = total = 0
for task, data in sides["before"].items():
    for row in data["rows"]:
        other = next(r for r in sides["after"][task]["rows"] if r["mechanism"] == row["mechanism"])
        equal = row["qualities"] == other["qualities"]
        same += equal; total += 1
        print(f"{task:8s} {row['mechanism']:7s} before {row['quality_mean']:.6f} after {other['quality_mean']:.6f}"
              f" {'identical' if equal else 'DIFFERENT'} (seeds {row['qualities']} / {other['qualities']})")
print(f"{same} of {total} (task, mechanism) cells identical in every seed")
