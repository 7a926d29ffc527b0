"""Where a synchronous replica's variables live, one class each: in the buckets in host
memory (HostVariables: the CPU) or on the device (DeviceVariables: a GPU, the stand-in).

On a GPU the variables and their optimizer slots live on the device. Each step, the
gradients go to the host through page-locked memory (one copy each, started as backward
produces it: MPICH is not CUDA-aware), the replicas reduce them in host buckets (the mean of
each part, clipping included), and the mean comes back to the device in one copy, where
every replica applies the same update to its own copy of the variables: identical by
construction, as the replica check verifies. With one replica (one process) nothing is
reduced: the update runs on the device straight after backward, and no byte crosses but
the batch (none when the data is on the device: data.on_device).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...allreduce import GradientBuckets, Update, broadcast
from ...device.staging import StagedGradients
from ...models.variables import VariableSpec
from ...optim import clip_by_global_norm
from ...run.startup import Prepared
from ..base import RunContext


class HostVariables:
    """The variables, slots and gradients are views into the buckets: each replica updates
    its part of every bucket, and the result is shared (allreduce)."""

    slots_in_buckets = True  # the optimizer slots are bucket views too (updated in parts)

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.params: dict[str, Any] = {}
        self.slots: dict[str, dict[str, Any]] = {}
        self.grads: dict[str, Any] = {}
        self.live: dict[str, Any] = self.params  # what the model reads (run.params)

    def bucketed(self, specs: list[VariableSpec]) -> list[VariableSpec]:
        """The variables the buckets hold (every one, here)."""
        return specs

    def attach(self, buckets: GradientBuckets, specs: list[VariableSpec]) -> None:
        """The buckets' views, by variable."""
        self.params.update({s.name: buckets.values[s.name] for s in specs})
        self.slots = {s.name: buckets.slots[s.name] for s in specs}
        self.grads = {s.name: buckets.grads[s.name] for s in specs}  # (not the loss)

    def set_initial(self, prep: Prepared) -> None:
        """Chief: the initial or restored variables and slots, before they are shared."""
        for name in self.params:
            self.params[name][...] = prep.values[name]
            for k in self.ctx.optimizer.slots:
                self.slots[name][k][...] = prep.slots[f"{name}/{k}"]

    def shared_initial(self, buckets: GradientBuckets) -> None:
        """Every replica, once the chief's initial state is its own (buckets.share)."""

    def host_params(self) -> dict[str, np.ndarray]:
        """This replica's variables in host memory (checkpoints, the replica check)."""
        return self.params

    def whole_slots(self, buckets: GradientBuckets) -> dict[str, np.ndarray]:
        """Chief: every optimizer slot whole (each replica updates only its part), by name
        as a checkpoint holds them."""
        buckets.collect_slots()
        return {f"{n}/{k}": a for n, s in self.slots.items() for k, a in s.items()}

    def on_device(
        self, x: Any, y: Any, params: dict[str, Any], host_grads: dict[str, Any]
    ) -> tuple[Any, Any, dict[str, Any], dict[str, Any], StagedGradients]:
        """The batch, the variables and the gradient buffers where the model computes (the
        buckets themselves), and how gradients get back to them (nothing to copy)."""
        return x, y, params, host_grads, self.ctx.device.staged(host_grads, host_grads)

    def update_rule(self, lr: float, step: int) -> Update:
        """What a replica does with its part of each bucket's mean gradient: apply it."""
        apply = self.ctx.optimizer.apply

        def update(var: Any, grad: Any, slots: dict[str, Any]) -> None:
            apply(var, grad, slots, lr, step + 1)

        return update

    def apply_mean(self, lr: float, step: int, timed: bool) -> None:
        """After the step is shared: the variables in the buckets are updated already."""

    def release(self, buckets: GradientBuckets) -> None:
        """Before the buckets go: shared memory goes with them, so the variables the run
        returns (run.params) become copies."""
        if buckets.shared:
            for name, value in self.params.items():
                self.params[name] = value.copy()


class DeviceVariables:
    """The variables and slots on the device; the buckets carry gradients (and their means),
    and with one replica nothing at all."""

    slots_in_buckets = False  # the slots are on the device only

    def __init__(self, ctx: RunContext):
        self.ctx, self.device = ctx, ctx.device
        self.alone = ctx.cluster.layout.num_workers == 1  # one replica: nothing to reduce
        specs, xp, slot_names = ctx.model.variables(), ctx.device.xp, ctx.optimizer.slots
        self.means: dict[str, Any] = {}  # the buckets' variables: each step's mean gradients
        self.grads: dict[str, Any] = {}
        self.params = {s.name: np.zeros(s.shape, s.dtype) for s in specs}  # host copies
        self.host_slots = {
            s.name: {k: np.zeros(s.shape, s.dtype) for k in slot_names} for s in specs
        }
        self.live = {s.name: xp.zeros(s.shape, s.dtype) for s in specs}
        self.device_slots = {
            s.name: {k: xp.zeros(s.shape, s.dtype) for k in slot_names} for s in specs
        }
        self.device_grads = {s.name: xp.zeros(s.shape, s.dtype) for s in specs}

    def bucketed(self, specs: list[VariableSpec]) -> list[VariableSpec]:
        return [] if self.alone else specs

    def attach(self, buckets: GradientBuckets, specs: list[VariableSpec]) -> None:
        self.means = {s.name: buckets.values[s.name] for s in specs}
        self.grads = {s.name: buckets.grads[s.name] for s in specs}
        self.device.pin(buckets.host_arrays() if not self.alone else [])

    def set_initial(self, prep: Prepared) -> None:
        for name, value in self.params.items():
            value[...] = prep.values[name]
            for k, slot in self.host_slots[name].items():
                slot[...] = prep.slots[f"{name}/{k}"]

    def shared_initial(self, buckets: GradientBuckets) -> None:
        """The chief's variables and slots (one broadcast) onto this replica's device."""
        host = [self.params[n] for n in self.live]
        host += [a for s in self.host_slots.values() for a in s.values()]
        if not self.alone:
            broadcast(self.ctx.cluster.workers, host)
        for name, value in self.params.items():
            self.live[name].set(value)
            for k, a in self.host_slots[name].items():
                self.device_slots[name][k].set(a)

    def host_params(self) -> dict[str, np.ndarray]:
        """The device variables copied into host memory (checkpoints, the replica check)."""
        for name, value in self.live.items():
            value.get(out=self.params[name])
        return self.params

    def whole_slots(self, buckets: GradientBuckets) -> dict[str, np.ndarray]:
        for name, slots in self.device_slots.items():
            for k, a in slots.items():
                a.get(out=self.host_slots[name][k])
        return {f"{n}/{k}": a for n, s in self.host_slots.items() for k, a in s.items()}

    def on_device(
        self, x: Any, y: Any, params: dict[str, Any], host_grads: dict[str, Any]
    ) -> tuple[Any, Any, dict[str, Any], dict[str, Any], StagedGradients]:
        """The batch and the device variables; table rows pulled into host buffers (hybrid
        mode) copied in, and their gradients copied out with the dense ones, each as
        backward says it is ready (alone, the dense ones stay on the device)."""
        device = self.device
        x, y = device.to_device(x, "x"), device.to_device(y, "y")
        rows = {name: a for name, a in params.items() if name not in self.live}
        if not rows:  # (sync: the device's own variables and gradients, nothing copied)
            return x, y, self.live, self.device_grads, device.staged(self.device_grads, host_grads)
        params = {**self.live, **device.stage_in(rows)}
        grads = {**self.device_grads, **device.mirrors({n: host_grads[n] for n in rows})}
        return x, y, params, grads, device.staged(grads, host_grads)

    def update_rule(self, lr: float, step: int) -> Update:
        """The buckets keep each part's mean gradient (clipped) as it is: the device applies
        it."""

        def keep_mean(mean: Any, grad: Any, slots: dict[str, Any]) -> None:
            mean[...] = grad

        return keep_mean

    def apply_mean(self, lr: float, step: int, timed: bool) -> None:
        """The mean gradients onto the device (into the gradient buffers, copied out
        already), and the update there; alone, this replica's own gradients, clipped on
        the device."""
        grads, optimizer = self.device_grads, self.ctx.optimizer
        if self.alone:  # (on the device, without a wait: see clip_by_global_norm)
            clip_by_global_norm(list(grads.values()), self.ctx.oc.clip_norm)
        for name, mean in self.means.items():
            grads[name].set(mean)
        for name, var in self.live.items():
            optimizer.apply(var, grads[name], self.device_slots[name], lr, step + 1)
        # the means' copies read, before the buckets take the next; alone, nothing waits for
        # the update (it runs while the host makes the next batch, and the next step's loss,
        # read after its forward, is the step's one wait) unless the timeline measures it
        if not self.alone or timed:
            self.device.synchronize()

    def release(self, buckets: GradientBuckets) -> None:
        """The run's final variables, in host memory."""
        self.host_params()
