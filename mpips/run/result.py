"""What one rank's run returns (``mpips.train``; ``train --result FILE`` writes it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..placement.layout import Role
from ..process import preemption


@dataclass
class TrainResult:
    """What one rank saw. Evaluation fields are set on the chief only."""

    role: Role
    start_step: int
    global_step: int
    updates: int = 0  # updates this worker pushed
    examples: int = 0  # examples this worker trained on
    seconds: float = 0.0
    total_examples: int = 0  # over all workers (chief only)
    test_accuracy: float | None = None
    test_loss: float | None = None
    test_auc: float | None = None  # sparse CTR models
    test_metrics: dict[str, float] | None = None  # everything evaluate() returned (chief)
    staleness: list[dict[str, Any]] | None = None  # per worker task (chief: all workers)
    validation: list[dict[str, Any]] | None = None  # chief, train.eval_every: each evaluation
    stopped_by: int = 0  # signal that stopped the run early (preemption), else 0
    # survive mode (chief): each worker lost mid-run, as store/liveness.py's lost_rank
    lost: list[dict[str, Any]] | None = None
    acting_chief: bool = False  # survive mode: this worker took over from a lost chief

    @property
    def is_chief(self) -> bool:
        """Whether this rank ended the run as the chief (its report, its result file)."""
        return self.role.is_chief or self.acting_chief

    def to_json(self) -> dict[str, Any]:
        """The result as plain JSON values (``train --result FILE``)."""
        out = {k: v for k, v in vars(self).items() if k not in ("role", "acting_chief")}
        for k, v in out.items():  # strict JSON: a NaN metric (one-class split) is null
            if isinstance(v, float) and v != v:
                out[k] = None
        if self.test_metrics:
            out["test_metrics"] = {k: (None if v != v else v) for k, v in self.test_metrics.items()}
        out["task"] = f"/job:{self.role.job}/task:{self.role.task}"
        out["stopped_by"] = preemption.name(self.stopped_by) if self.stopped_by else None
        return out
