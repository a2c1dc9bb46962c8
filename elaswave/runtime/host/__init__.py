"""The job host (``elaswave train`` / ``elaswave run`` on node 0) and the agents of other
hosts: :mod:`.launcher` serves the store, owns the worker processes and runs (and
restarts) the Core; :mod:`.zygote` forks them with the runtime already loaded;
:mod:`.nodeagent` runs on every other host and :mod:`.nodes` is node 0's view of those;
:mod:`.tensorboard` writes the job's scalars and :mod:`.profile` measures layer costs
before the job starts."""
