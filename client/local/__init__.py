"""A local cluster: the embedded Redis-protocol server and sets of replicas, for `replicadp up` / `down`, the demo,
the sweep, the bench scripts and the tests."""
