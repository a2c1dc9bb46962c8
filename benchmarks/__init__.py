"""The paper's baselines, to measure ElasWave against; never imported by ``elaswave``.

* :mod:`benchmarks.contiguous`: the contiguous ZeRO layout that ElasWave's interleaved
  one replaces, and the plans that move one layer's optimizer state between stages under
  each layout; :mod:`benchmarks.migration_exec` executes such a plan over p2p links
  (``scripts/bench_zero_migration.py``).
* :mod:`benchmarks.rebuild`: the partial and the full restart of the communicator, the
  baselines of ElasWave's dynamic edit (``scripts/bench_communicator.py``).

``benchmarks`` is not installed: the scripts that use it put the repository root on
``sys.path``, and pytest has it on its ``pythonpath`` (``pyproject.toml``).
"""
