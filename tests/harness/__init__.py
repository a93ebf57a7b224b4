"""The suite's shared harness, one module per job:

- ``runs``: launch training runs (one process, torchrun, several layouts per launch) and read what
  they wrote; the FAST settings every test run starts from.
- ``parity``: layouts, the parity matrix's comparisons with the one-process reference, ``Parity``.
- ``store``: runs shared by the whole session, across pytest-xdist's workers.
- ``tolerance``: parity tolerances derived from the one-process run's own sensitivity.
- ``layout_batch``: the script a batched launch runs on every rank.
- ``process_guard``: ``-m "not multirank"`` starts no ranks.
- ``gloo_ranks``: forked gloo ranks for a test of one function that runs collectives.
- ``inventory``: tests/CLAIMS.md against the collected suite.
- ``chat_files``, ``data_files``, ``hf_files``: the files tests train on; ``virtual_cluster``: nodes
  as network namespaces, and a SLURM cluster on them.

tests/conftest.py holds only the fixtures and hooks pytest looks up there.
"""
