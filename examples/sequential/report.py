"""Print a next-item run's last val and its test HR@10 / NDCG@10, full-catalogue and sampled:
the last val evaluation and the final test row of its metrics.jsonl (examples/sequential/run.sh
ends with it)."""

import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
val = [r for r in rows if r.get("split") in ("val", "eval") and "sampled_hr@10" in r]
if not rows or rows[-1].get("split") != "test" or not val:
    sys.exit(f"run.sh: {sys.argv[1]} does not end with a val and a test evaluation; see above")
for name, r in (("val", val[-1]), ("test", rows[-1])):
    print(
        f"{name:4s} sampled HR@10 {r['sampled_hr@10']:.4f}  NDCG@10 {r['sampled_ndcg@10']:.4f}  "
        f"full-catalogue HR@10 {r['hr@10']:.4f}  NDCG@10 {r['ndcg@10']:.4f}  "
        f"({int(r['eval_samples'])} users, step {r['step']})"
    )
