"""Every parallelism, one module each, and ``compose.parallelize``, the order they apply in.

The package imports nothing itself: a run imports the parallelisms it uses (DTensor, FSDP and
torch's pipelining cost seconds of start-up on every rank that does not need them).
"""
