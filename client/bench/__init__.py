"""Benchmarks: the throughput bench and its isolation check, the replica-count sweep, the demo, and a model's
size and FLOPs (`describe-model`)."""
