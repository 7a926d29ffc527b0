"""A model of your own, as a user writes it: softmax regression with L2, for mpips.

Named from a job file as ``model.kind = "my_model:build"`` (see jobs/my_model.toml; mpips
looks for the module beside the job file first). It computes with ``self.xp``, so the same
code runs on numpy and on cupy, and writes gradients into the buffers mpips hands it. The
README's "Your own model" shows this file.
"""
import numpy as np

import mpips


class Softmax(mpips.Model):
    def __init__(self, inputs, classes, l2=0.0):
        self.inputs, self.classes, self.l2 = inputs, classes, l2

    def variables(self):                      # name, shape, dtype (default float32)
        return [mpips.Variable("w", (self.inputs, self.classes)),
                mpips.Variable("b", (self.classes,))]

    def initial_values(self, seed):           # numpy arrays, by name
        rng = np.random.default_rng(seed)
        return {"w": rng.normal(0, 0.01, (self.inputs, self.classes)).astype(np.float32),
                "b": np.zeros(self.classes, np.float32)}

    def loss_and_grads(self, params, x, y, grads, ready=None):
        xp, n = self.xp, len(y)               # xp: numpy, or cupy on a GPU worker
        z = x @ params["w"] + params["b"]
        p = xp.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        loss = -xp.log(p[xp.arange(n), y] + 1e-12).mean()
        p[xp.arange(n), y] -= 1
        p /= n
        grads["w"][...] = x.T @ p + self.l2 * params["w"]   # write in place: the push buffer
        grads["b"][...] = p.sum(axis=0)
        return float(loss)

    def predict(self, params, x):             # optional: `python -m mpips predict`
        z = x @ params["w"] + params["b"]
        p = self.xp.exp(z - z.max(axis=1, keepdims=True))
        return p / p.sum(axis=1, keepdims=True)

    def evaluate(self, params, x, y):         # any metrics: "accuracy", "loss", "auc" first
        p = self.predict(params, x)
        loss = -self.xp.log(p[self.xp.arange(len(y)), y] + 1e-12).mean()
        return {"loss": float(loss), "accuracy": float((p.argmax(axis=1) == y).mean())}

def build(data, l2=0.0):                      # data.num_inputs, data.num_classes
    return Softmax(data.num_inputs, data.num_classes, l2)
