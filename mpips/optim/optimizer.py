"""An optimizer: a kind and its hyper-parameters, which name its rule (rules.py); the rule
run by the fastest form that fits the arrays (fused.py); a job's [optimizer] table read."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..device.kernels import is_cupy
from . import fused
from .fused import apply_fused, cupy_apply, timed_array_form
from .rules import HYPER, Array, Rule, find_rule, rule_for


@dataclass(frozen=True)
class Optimizer:
    """An update rule with its hyper-parameters; ``slots`` are the per-variable state arrays."""

    kind: str
    hyper: dict[str, Any] = field(default_factory=dict)
    # a run's start-up found its updates too small for a fused kernel to pay (plan_kernel):
    # none is loaded while it runs (one this process already has is used)
    numpy_only: bool = field(default=False, compare=False)

    @property
    def rule(self) -> Rule:
        """The rule of this kind with these hyper-parameters (momentum: Nesterov's or not)."""
        return rule_for(self.kind, self.hyper)

    @property
    def slots(self) -> tuple[str, ...]:
        return self.rule.slots

    @property
    def stateful(self) -> bool:
        """Has slots, so a PS applies it (plain SGD is a delta the workers Accumulate); with
        zero copy the workers apply every rule themselves."""
        return bool(self.slots)

    def init_slots(self, var: np.ndarray) -> dict[str, np.ndarray]:
        return self.rule.init_slots(var, self.hyper)

    def apply(self, var: Array, grad: Array, slots: dict[str, Array], lr: float, t: int) -> None:
        """Update ``var`` and its ``slots`` in place with ``grad``; ``t`` is the 1-based update
        count. C-contiguous float32 numpy arrays go through the rule's fused kernel once it
        is compiled (in the background, once the array forms have taken COMPILE_AFTER
        seconds of this process), float32 cupy arrays through its cupy kernel, anything
        else through its array form (numpy or cupy); all give the same bits."""
        rule, h = self.rule, self.hyper
        if is_cupy(var):  # a GPU: the rule's cupy kernel
            if cupy_apply(rule, h, var, grad, slots, lr, t):
                return
        else:
            done = apply_fused(rule, h, var, grad, slots, lr, t, False, not self.numpy_only)
            if done:
                return
            if done is None:  # a kernel would fit: the array form's time counts towards it
                timed_array_form(rule, h, var, grad, slots, lr, t)
                return
        rule.array(var, grad, slots, lr, t, h)


def plan_kernel(optimizer: Optimizer, elements: int) -> tuple[Optimizer, str | None]:
    """At a run's start-up, in a process each of whose updates applies ``optimizer``'s rule
    to ``elements`` float32 elements on the CPU: the optimizer for the run, and the fused
    kernel it starts loading now, in the background (await_kernel before the first step),
    where one update costs the array form at least PAYS_PER_UPDATE seconds. Else no kernel,
    and the run's optimizer keeps the array forms (``numpy_only``): no compile starts among
    its steps (a kernel this process already has is used; the bits are the same)."""
    rule = find_rule(optimizer.kind, optimizer.hyper)
    if rule is None or not fused.fused_kernels_on():
        return optimizer, None
    if elements * rule.numpy_seconds < fused.PAYS_PER_UPDATE:
        return replace(optimizer, numpy_only=True), None
    fused.fused_kernel(rule.name, wait=False)
    return replace(optimizer, numpy_only=False), rule.name


def unused_settings(cfg: Any) -> list[str]:
    """The [optimizer] settings a job changes from their defaults that its rule does not
    read (``nesterov = true`` with ``kind = "adagrad"``; ``decay_rate`` with the constant
    schedule), each said with why, so a run says so rather than train without them."""
    default = type(cfg)()
    notes = [
        (k, f"kind {cfg.kind!r} does not use it")
        for k in dict.fromkeys(sum(HYPER.values(), ()))
        if k not in HYPER[cfg.kind]
    ]
    if cfg.schedule == "constant":
        notes += [
            (k, "the constant schedule does not use it") for k in ("decay_rate", "decay_steps")
        ]
    return [
        f"optimizer.{k} = {getattr(cfg, k)!r} has no effect: {why}"
        for k, why in notes
        if getattr(cfg, k) != getattr(default, k)
    ]


def build_optimizer(cfg: Any) -> Optimizer:
    """The optimizer named by a job's [optimizer] table."""
    return Optimizer(cfg.kind, {k: getattr(cfg, k) for k in HYPER[cfg.kind]})
