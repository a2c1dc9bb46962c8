"""A training process: one (stage, replica), or one member of its tensor-parallel group.

:mod:`.process` is its entry point; :mod:`.steploop` trains step by step and answers a
change inside the step through :mod:`.executor`, which agrees on the Core's plan and
applies it: :mod:`.reconfigure` turns one :mod:`.trainer` into the next.
:mod:`.pipeline` runs a stage under 1F1B, :mod:`.migration` the data-plane half of a
non-blocking layer move; :mod:`.holders` and :mod:`.held_checkpoint` are what a snapshot
holder keeps and writes; :mod:`.tpgroup` is its tensor-parallel group; :mod:`.emulation`
and :mod:`.frequency` keep a modelled device's time and clocks; :mod:`.heartbeat`,
:mod:`.outage` and :mod:`.faults` are its liveness, its side of a Core outage and
injected faults; :mod:`.script` runs the user's script (``elaswave run``)."""
