"""TensorFlow 1.x's distributed MNIST example (tools/dist_test/python/mnist_replica.py) ported
to mpips: the same four variables, initial values, loss and gradients. Its flags are the job
files jobs/mnist_replica.toml (async) and jobs/mnist_replica_sync.toml (--sync_replicas);
docs/migrating-from-tensorflow.md walks through the port line by line.

    hid_w = tf.Variable(tf.truncated_normal([784, hidden_units], stddev=1.0 / 28))
    hid_b = tf.Variable(tf.zeros([hidden_units]))
    sm_w = tf.Variable(tf.truncated_normal([hidden_units, 10],
                                           stddev=1.0 / math.sqrt(hidden_units)))
    sm_b = tf.Variable(tf.zeros([10]))
    hid = tf.nn.relu(tf.nn.xw_plus_b(x, hid_w, hid_b))
    y = tf.nn.softmax(tf.nn.xw_plus_b(hid, sm_w, sm_b))
    cross_entropy = -tf.reduce_sum(y_ * tf.log(tf.clip_by_value(y, 1e-10, 1.0)))
"""

import math

import numpy as np

import mpips

IMAGE_PIXELS = 28
CLIP = 1e-10  # tf.clip_by_value(y, 1e-10, 1.0)


def truncated_normal(rng, shape, stddev):
    """tf.truncated_normal: N(0, stddev^2), a value beyond 2 stddev drawn again (float32)."""
    out = rng.normal(0.0, stddev, shape)
    outside = np.abs(out) > 2 * stddev
    while outside.any():
        out[outside] = rng.normal(0.0, stddev, int(outside.sum()))
        outside = np.abs(out) > 2 * stddev
    return out.astype(np.float32)


class MnistReplica(mpips.Model):
    """mnist_replica.py's model: one ReLU hidden layer, a softmax layer, and TF's loss, the
    cross-entropy summed over the batch (so the gradients are sums too, as TF's were;
    ``loss_and_grads`` returns the batch's mean, which mpips logs)."""

    def __init__(self, inputs, classes, hidden_units=100):
        self.inputs, self.classes, self.hidden = inputs, classes, hidden_units

    def variables(self):  # creation order, as in TF's graph (placement follows it)
        return [
            mpips.Variable("hid_w", (self.inputs, self.hidden)),
            mpips.Variable("hid_b", (self.hidden,)),
            mpips.Variable("sm_w", (self.hidden, self.classes)),
            mpips.Variable("sm_b", (self.classes,)),
        ]

    def initial_values(self, seed):
        rng = np.random.default_rng(seed)
        return {
            "hid_w": truncated_normal(rng, (self.inputs, self.hidden), 1.0 / IMAGE_PIXELS),
            "hid_b": np.zeros(self.hidden, np.float32),
            "sm_w": truncated_normal(rng, (self.hidden, self.classes), 1 / math.sqrt(self.hidden)),
            "sm_b": np.zeros(self.classes, np.float32),
        }

    def forward(self, params, x):
        """(hid, y): the hidden layer's output and the class probabilities."""
        xp = self.xp
        hid = xp.maximum(x @ params["hid_w"] + params["hid_b"], 0)
        z = hid @ params["sm_w"] + params["sm_b"]
        e = xp.exp(z - z.max(axis=1, keepdims=True))
        return hid, e / e.sum(axis=1, keepdims=True)

    def loss_and_grads(self, params, x, y, grads, ready=None):
        xp, n = self.xp, len(y)
        hid, probs = self.forward(params, x)
        rows = xp.arange(n)
        picked = probs[rows, y]
        d = probs.copy()  # d cross_entropy / d logits: y - y_, row by row
        d[rows, y] -= 1
        d *= (picked >= CLIP)[:, None]  # clip_by_value passes no gradient below its minimum
        grads["sm_w"][...] = hid.T @ d
        grads["sm_b"][...] = d.sum(axis=0)
        d_hid = (d @ params["sm_w"].T) * (hid > 0)
        grads["hid_w"][...] = x.T @ d_hid
        grads["hid_b"][...] = d_hid.sum(axis=0)
        return float(-xp.log(xp.clip(picked, CLIP, 1.0)).mean())

    def predict(self, params, x):
        return self.forward(params, x)[1]

    def evaluate(self, params, x, y):
        """The mean cross-entropy ("loss"), "accuracy", and "cross_entropy": TF's summed
        cross-entropy, what mnist_replica.py printed for its validation set."""
        probs = self.predict(params, x)
        xent = -self.xp.log(self.xp.clip(probs[self.xp.arange(len(y)), y], CLIP, 1.0))
        return {
            "loss": float(xent.mean()),
            "accuracy": float((probs.argmax(axis=1) == y).mean()),
            "cross_entropy": float(xent.sum()),
        }


def build(data, hidden_units=100):
    """``model.kind = "mnist_replica:build"``; ``[model.args] hidden_units`` is the flag."""
    return MnistReplica(data.num_inputs, data.num_classes, hidden_units)
