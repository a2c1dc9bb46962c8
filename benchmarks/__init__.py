"""The paper's baselines, to measure ElasWave against; never imported by ``elaswave``.

* :mod:`benchmarks.contiguous`: the contiguous ZeRO layout that ElasWave's interleaved
  one replaces, and the plans that move one layer's optimizer state between stages under
  each layout; :mod:`benchmarks.migration_exec` executes such a plan over p2p links
  (``scripts/bench_zero_migration.py``).
* :mod:`benchmarks.rebuild`: the partial and the full restart of the communicator, the
  baselines of ElasWave's dynamic edit (``scripts/bench_communicator.py``).

The scripts and tests that use them import them from the repository root (the scripts put
it on ``sys.path``; pytest's root is already there); ``benchmarks`` is not installed.
"""
