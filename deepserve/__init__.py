"""deepserve's tools: the command line, the local supervisor (``deepserve up``) and the
benchmarks. They use the services and the libraries; nothing under ``libs/`` or ``services/``
imports this package."""
