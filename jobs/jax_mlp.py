"""The reference MLP in JAX: a pure loss function of a pytree of parameters, trained by
mpips. Named from jobs/jax_mlp.toml as ``model.kind = "jax_mlp:build"``."""

import jax
import jax.numpy as jnp

import mpips.jax


def build(data, hidden=(512, 512)):
    sizes = [data.num_inputs, *hidden, data.num_classes]

    def init(key):
        """He-uniform kernels, zero biases: {"dense_0": {"kernel", "bias"}, ...}."""
        params = {}
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            key, sub = jax.random.split(key)
            limit = jnp.sqrt(6.0 / fan_in)
            params[f"dense_{i}"] = {
                "kernel": jax.random.uniform(sub, (fan_in, fan_out), minval=-limit, maxval=limit),
                "bias": jnp.zeros(fan_out),
            }
        return params

    def logits(params, x):
        for i in range(len(sizes) - 1):
            x = x @ params[f"dense_{i}"]["kernel"] + params[f"dense_{i}"]["bias"]
            if i < len(sizes) - 2:
                x = jax.nn.relu(x)
        return x

    def loss(params, x, y):
        z = logits(params, x)
        labels = y.astype(jnp.int32)[:, None]
        mean_nll = -jnp.take_along_axis(jax.nn.log_softmax(z), labels, axis=1).mean()
        return mean_nll, {"accuracy": jnp.mean(jnp.argmax(z, axis=1) == y)}

    def predict(params, x):
        return jax.nn.softmax(logits(params, x))

    return mpips.jax.Model(loss, init, predict)
