"""The engines the modes run, composed from collaborators: the PS engine (ps.py), the worker
of the modes whose PS tasks hold the variables (store_worker.py, stepping as
async_worker.py or replicas_worker.py says), and the synchronous replica (replica.py, with
its variables' home and its table rows from replica_variables.py and replica_rows.py)."""
