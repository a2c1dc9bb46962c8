"""What every process of a job shares: the spec and configuration in ``RUN_DIR/job.json``
(:mod:`.config`), the injected faults (:mod:`.faults`), the planner inputs a plan change
carries (:mod:`.inputs`), the link between the job host and the Core (:mod:`.hostlink`)
and what each child process does on its way in and out (:mod:`.child`)."""
