"""Synchronous replicas' data movement: gradient buckets reduced over the replicas and the
update sharded over them (mechanism: it imports no policy)."""
