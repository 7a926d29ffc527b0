"""A synchronous replica on a GPU: its variables and optimizer slots live on the device.

Each step the model reads the variables where they are and writes its gradients into device
buffers kept from step to step; each gradient is copied to the host buckets as backward says
it is ready (each byte once), the buckets take the mean over the replicas there (node shared
memory, or reduce-scatter and all-gather across nodes: the PyPI MPICH is not CUDA-aware),
clipping included, and the mean comes back to the device in one copy, where every replica
applies the same update to its own copy of the variables: identical by construction, as the
replica check verifies. With one replica (one process) nothing is reduced: the update runs
on the device straight after backward, and no byte crosses but the batch (none when the
data is on the device: data.on_device).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..allreduce import Update, broadcast
from ..device.backend import Device, StagedGradients
from ..job import Job
from ..models.variables import VariableSpec
from ..optim import Optimizer, clip_by_global_norm
from ..run.hooks import Hook
from ..run.session import TrainResult
from ..run.startup import Prepared
from ..store import Cluster
from .base import Mode
from .replica import Replica


class DeviceReplica(Replica):
    """Replica with its variables and slots on the device; the buckets carry gradients."""

    slots_in_buckets = False  # the slots are on the device only

    def __init__(
        self,
        job: Job,
        mode: Mode,
        cluster: Cluster,
        optimizer: Optimizer,
        prep: Prepared,
        device: Device,
    ):
        super().__init__(job, mode, cluster, optimizer, prep, device)
        xp, specs = device.xp, self.model.variables()
        # the buckets' variables hold each step's mean gradients; the variables and slots
        # are on the device, with host copies made when asked
        self.means = self.params
        self.params = {s.name: np.zeros(s.shape, s.dtype) for s in specs}
        self.host_slots = {
            s.name: {k: np.zeros(s.shape, s.dtype) for k in optimizer.slots} for s in specs
        }
        self.live = {s.name: xp.zeros(s.shape, s.dtype) for s in specs}
        self.device_slots = {
            s.name: {k: xp.zeros(s.shape, s.dtype) for k in optimizer.slots} for s in specs
        }
        self.device_grads = {s.name: xp.zeros(s.shape, s.dtype) for s in specs}
        device.pin(self.buckets.host_arrays() if not self.alone else [])

    @property
    def alone(self) -> bool:
        """One replica (one process): nothing to reduce but the loss."""
        return self.workers == 1

    def _bucketed(self, specs: list[VariableSpec]) -> list[VariableSpec]:
        return [] if self.alone else specs

    def train(self, extra_hooks: list[Hook]) -> TrainResult:
        result = super().train(extra_hooks)
        self.host_params()  # the run's final variables, in host memory
        return result

    def _set_initial(self, prep: Prepared) -> None:
        for name, value in self.params.items():
            value[...] = prep.values[name]
            for k, slot in self.host_slots[name].items():
                slot[...] = prep.slots[f"{name}/{k}"]

    def _shared_initial(self) -> None:
        """The chief's variables and slots (one broadcast) onto this replica's device."""
        host = [self.params[n] for n in self.live]
        host += [a for s in self.host_slots.values() for a in s.values()]
        if not self.alone:
            broadcast(self.comm, host)
        for name, value in self.params.items():
            self.live[name].set(value)
            for k, a in self.host_slots[name].items():
                self.device_slots[name][k].set(a)

    def host_params(self) -> dict[str, np.ndarray]:
        """The device variables copied into host memory (checkpoints, the replica check)."""
        for name, value in self.live.items():
            value.get(out=self.params[name])
        return self.params

    def whole_slots(self) -> dict[str, np.ndarray]:
        for name, slots in self.device_slots.items():
            for k, a in slots.items():
                a.get(out=self.host_slots[name][k])
        return {f"{n}/{k}": a for n, s in self.host_slots.items() for k, a in s.items()}

    def _on_device(
        self, x: Any, y: Any, params: dict[str, Any], host_grads: dict[str, Any]
    ) -> tuple[Any, Any, dict[str, Any], dict[str, Any], StagedGradients]:
        device = self.device
        x, y = device.to_device(x, "x"), device.to_device(y, "y")
        staged = device.staged(self.device_grads, host_grads)  # (alone: none; they stay)
        return x, y, self.live, self.device_grads, staged

    def _update_rule(self, lr: float, step: int) -> Update:
        """The buckets keep each part's mean gradient (clipped) as it is: the device applies
        it."""

        def keep_mean(mean: Any, grad: Any, slots: dict[str, Any]) -> None:
            mean[...] = grad

        return keep_mean

    def _apply_mean(self, lr: float, step: int) -> None:
        """The mean gradients onto the device (into the gradient buffers, copied out
        already), and the update there; alone, this replica's own gradients, clipped on
        the device."""
        grads = self.device_grads
        if self.alone:  # (on the device, without a wait: see clip_by_global_norm)
            clip_by_global_norm(list(grads.values()), self.oc.clip_norm)
        for name, mean in self.means.items():
            grads[name].set(mean)
        for name, var in self.live.items():
            self.optimizer.apply(var, grads[name], self.device_slots[name], lr, step + 1)
        # the means' copies read, before the buckets take the next; alone, nothing waits for
        # the update (it runs while the host makes the next batch, and the next step's loss,
        # read after its forward, is the step's one wait) unless the timeline measures it
        if not self.alone or self.timeline:
            self.device.synchronize()
