"""Config checks of model.task: each stop target reads its task's metric, retrieval's two-tower
model and top-K, next_item's sequences (hybridrec.config.next_item)."""

from __future__ import annotations

from hybridrec.config.next_item import check_next_item
from hybridrec.config.schema import Config
from hybridrec.config.values import positive


def check_task(c: Config) -> None:
    """Each stop target reads its task's metric; synthetic data has binary labels only."""
    task = c.model.task
    if c.eval.target_auc is not None and task != "binary":
        raise ValueError(
            f"eval.target_auc={c.eval.target_auc} needs model.task=binary (a regression model "
            "reports no AUC); use eval.target_rmse, or unset eval.target_auc"
        )
    if c.eval.target_rmse is not None:
        if task != "regression":
            raise ValueError(
                f"eval.target_rmse={c.eval.target_rmse} needs model.task=regression (a binary "
                "model reports no RMSE); use eval.target_auc, or unset eval.target_rmse"
            )
        positive("eval.target_rmse", c.eval.target_rmse)
    if task == "regression" and c.data.name == "synthetic":
        raise ValueError(
            "model.task=regression needs float labels, but data=synthetic makes binary labels "
            "only; use a file dataset (data=criteo data.path=...) or model.task=binary"
        )
    if task == "retrieval":
        check_retrieval(c)
    check_next_item(c)


def check_retrieval(c: Config) -> None:
    """model.task=retrieval: a two-tower model of a table dataset, its loss and its top-K."""
    m, r = c.model, c.train.retrieval
    if c.data.name != "table":
        raise ValueError(
            f"model.task=retrieval ranks a dataset's items for its users: it needs data=table "
            f"(every row one (user, item) interaction, in train/val/test splits), not "
            f"data.name={c.data.name}"
        )
    if not m.built_by_class() or (m._target_ is None and m.arch != "two_tower"):
        raise ValueError(
            f"model.task=retrieval needs a model with a user tower and an item tower: "
            f"model.arch=two_tower or your own model._target_ (docs/library.md), not "
            f"model.arch={m.arch}"
        )
    positive("train.retrieval.temperature", r.temperature)
    positive("train.retrieval.negatives", r.negatives, allow_zero=True)
    ks = list(c.eval.topk)
    if not ks or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in ks):
        raise ValueError(f"eval.topk must list positive integers (e.g. [10,50]), got {ks}")
