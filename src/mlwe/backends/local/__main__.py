"""``python -m mlwe.backends.local``: the workload daemon (same options as ``mlwe daemon``)."""

from mlwe.backends.local.cli import main

main()
