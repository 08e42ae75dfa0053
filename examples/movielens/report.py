"""Print a run's val and test RMSE: the last val evaluation and the final test row of its
metrics.jsonl (examples/movielens/run.sh and examples/two_tower/run.sh end with it)."""

import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
# val rows ("eval" in files written before rows were named by their split)
val = [r for r in rows if r.get("split") in ("val", "eval") and "rmse" in r]
if not rows or rows[-1].get("split") != "test" or not val:
    sys.exit(f"run.sh: {sys.argv[1]} does not end with a val and a test evaluation; see above")
test = rows[-1]
print(
    f"val RMSE {val[-1]['rmse']:.4f}  test RMSE {test['rmse']:.4f}  (test MAE "
    f"{test['mae']:.4f}, {test['eval_samples']} test ratings, step {test['step']})"
)
