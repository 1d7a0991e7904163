"""Built-in workload programs for demos and tests (run with ``python -m mlwe.programs.NAME``).

- ``synthetic``: real resident memory, real CPU load in phases, a loss curve,
  and failure modes (diverge, NaN, plateau, leak, crash, ignore SIGTERM);
- ``train_digits``: a real small training run on scikit-learn's bundled digits
  data set that checkpoints on SIGTERM and resumes to the same result.

They import only :mod:`mlwe.workload` (and, for ``train_digits``, scikit-learn from
the ``mlwe[pipelines]`` extra), so starting one is quick.
"""
