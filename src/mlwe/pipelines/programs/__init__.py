"""Programs that pipeline steps run as real processes (``python -m mlwe.pipelines.programs.X``).

- ``digits``: the drift case study's steps on scikit-learn's bundled digits
  data set (prepare, train, evaluate, and the batch-scoring service);
- ``infer_server``: the inference-scaling case study's HTTP model server.
"""
