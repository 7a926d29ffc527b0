"""Training data: reading a job's input, sharding it, and converting other formats to it.

batches.py finds a job's dense arrays (HDF5, ``.npz``, ``.npy`` or arrays handed to
``mpips.train``), gives each worker its shard of the rows and makes its batches, read whole
or streamed in chunks; sparse.py does the same for CTR data (CSR rows in HDF5); hdf5.py
opens every file mpips reads as plain data and refuses links to other files. convert.py
and ctr_convert.py are the converters behind ``python -m mpips data``, which write those
files once from other formats (your own arrays, Fashion-MNIST, the built-in digits,
libsvm/libffm/Criteo text, synthetic data). A package of its own so that an installed mpips
(``pip install .``, not only a checkout) carries it.
"""
