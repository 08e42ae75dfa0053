"""The dynamic-table policy's one home (hybridrec.dynamic_policy): every bad value is one
PolicyError naming its key, whatever its type, and the config names it as
model.dynamic.<table>.<key> from that key, not from the message's text."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrec.config import ModelConfig
from hybridrec.config.dynamic import check_dynamic
from hybridrec.dynamic_policy import POLICY_KEYS, Dynamic, PolicyError, policy_of

BAD = [
    ({"min_count": "3"}, "min_count", "must be int, got '3'"),
    ({"min_count": True}, "min_count", "must be int, got True"),  # a bool is no int
    ({"min_count": 0}, "min_count", "must be >= 1, got 0"),
    ({"min_count": 2.0}, "min_count", "must be int, got 2.0"),
    ({"probability": math.nan}, "probability", "must be in (0, 1], got nan"),
    ({"probability": math.inf}, "probability", "must be in (0, 1], got inf"),
    ({"probability": 0}, "probability", "must be in (0, 1], got 0"),
    ({"probability": "0.5"}, "probability", "must be a number, got '0.5'"),
    ({"probability": False}, "probability", "must be a number, got False"),
    ({"admit": "sometimes"}, "admit", "='sometimes' is not one of: always, count, probability"),
    ({"admit": 1}, "admit", "must be str (one of: always, count, probability), got 1"),
    ({"evict": ["lru"]}, "evict", "must be str (one of: lfu, lru, ttl), got ['lru']"),
    ({"evict": "ttl"}, "ttl_steps", "must be >= 1 with evict: ttl"),
    ({"ttl_steps": -1}, "ttl_steps", "must be >= 0, got -1"),
    ({"halflife": 0}, "halflife", "must be >= 1, got 0"),
    ({"unknown": "random"}, "unknown", "='random' is not one of: zeros, row"),
    ({"buckets": None}, "buckets", "must be int, got None"),
]


@pytest.mark.parametrize("given, key, problem", BAD, ids=[str(b[0]) for b in BAD])
def test_a_bad_value_is_one_policy_error_naming_its_key(given, key, problem):
    with pytest.raises(PolicyError) as e:
        Dynamic(**given)
    assert e.value.key == key and e.value.problem.startswith(problem), e.value
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)
    assert str(e.value).startswith(f"dynamic table: {key}")


@pytest.mark.parametrize("given, key, problem", BAD, ids=[str(b[0]) for b in BAD])
def test_the_config_names_the_bad_key_exactly(given, key, problem):
    m = ModelConfig(num_embeddings_per_feature=[64, 64], dynamic={"cat_1": given})
    with pytest.raises(ValueError) as e:
        check_dynamic(m)
    sep = "" if problem.startswith("=") else " "
    assert str(e.value).startswith(f"model.dynamic.cat_1.{key}{sep}{problem}"), e.value


def test_an_unknown_key_and_rows_that_do_not_split_are_named():
    with pytest.raises(PolicyError) as e:
        policy_of({"evict": "lru", "evcit": "lfu"})
    assert e.value.key == "evcit" and e.value.problem.startswith("is not a policy key")
    # 64 rows in 64 buckets leave no row for an id beside each bucket's unknown row
    m = ModelConfig(num_embeddings_per_feature=[64], dynamic={"cat_0": {"unknown": "row"}})
    with pytest.raises(ValueError, match=r"^model\.dynamic\.cat_0: the table's 64 rows .* >= 2"):
        check_dynamic(m)
    assert Dynamic(unknown="row", buckets=32).fits(64) and not Dynamic(buckets=3).fits(64)


def test_a_good_policy_is_normalised():
    assert Dynamic(probability=1) == Dynamic() and isinstance(
        Dynamic(probability=1).probability, float
    )
    assert POLICY_KEYS == (
        "admit", "min_count", "probability", "evict", "ttl_steps", "halflife", "unknown", "buckets",
    )  # fmt: skip
    assert policy_of({"evict": "ttl", "ttl_steps": 5}) == Dynamic(evict="ttl", ttl_steps=5)


def test_the_policy_and_the_spec_load_without_torch():
    """Preprocessing reads the spec without torch: the policy it checks with must not need it."""
    code = (
        "import sys; import hybridrec.dynamic_policy, hybridrec.data.spec; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
