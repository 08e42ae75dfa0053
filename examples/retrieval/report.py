"""Print a retrieval run's val and test HR@10, NDCG@10 and HR@50: the last val evaluation and
the final test row of its metrics.jsonl (examples/retrieval/run.sh ends with it)."""

import json
import sys

KEYS = ("hr@10", "ndcg@10", "hr@50")
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
# val rows ("eval" in files written before rows were named by their split)
val = [r for r in rows if r.get("split") in ("val", "eval") and "hr@10" in r]
if not rows or rows[-1].get("split") != "test" or not val:
    sys.exit(f"run.sh: {sys.argv[1]} does not end with a val and a test evaluation; see above")
for name, row in (("val ", val[-1]), ("test", rows[-1])):
    scores = "  ".join(f"{k.upper()} {row[k]:.4f}" for k in KEYS)
    print(f"{name}  {scores}  ({row['eval_samples']} users, step {row['step']})")
