"""The runtime: the processes of a job, one subpackage each.

- :mod:`~elaswave.runtime.job`: what every process of a job shares: its spec and
  configuration (``job.json``), the injected faults, the planner inputs a plan change
  carries, the link between the job host and the Core.
- :mod:`~elaswave.runtime.core`: the Core process: the bus broker and event recorder,
  the supervisor (the shell around the pure change protocol), what it observes, the
  fail-slow watch, the TP groups as failure units, the run's summary and replay.
- :mod:`~elaswave.runtime.worker`: a training process: its step loop, the executor of
  plan changes, the trainer, the 1F1B stage runner, layer migration, snapshot holders,
  TP groups, device emulation and clocks, heartbeats, the Core-outage pause, and the
  user's script (``elaswave run``).
- :mod:`~elaswave.runtime.host`: the job host (``elaswave train``): the launcher, the
  zygote that forks the Core and the workers, node agents of other hosts, TensorBoard
  scalars and layer profiling.

The Core and the workers never import each other: they meet on the bus
(:mod:`elaswave.bus.schema`) and in the job's spec. ``job`` imports neither; the host
imports both, since it starts them.
"""
