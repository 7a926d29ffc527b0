"""The models wing: the model contract every model implements, the variables it declares, the
built-in models (the MLP, the CTR models), table initial values and evaluation metrics.
(The framework frontends, ``mpips.torch`` and ``mpips.jax``, live beside it.)"""
