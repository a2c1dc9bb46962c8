"""The Core process: it hosts the bus broker and records every event (:mod:`.recorder`),
runs the change protocol behind a thin shell (:mod:`.supervisor`, fed by :mod:`.observe`
and the fail-slow watch :mod:`.slowwatch`), sees each tensor-parallel group as one
failure unit (:mod:`.units`), and writes the run's summary (:mod:`.summary`).
:mod:`.process` is its entry point; :mod:`.replay` recomputes a run's plans from its
event log."""
