"""The phases of a plan change, one module each: what every input and every deadline
does while the change is in that phase (pure; :mod:`elaswave.engine.protocol` dispatches
to them).

- :mod:`.detecting`: no change under way, and exits gathered for ``grace_s``: how a
  change begins (a failure, a join, a rebalance, failures left for the next change);
- :mod:`.stopping`: every member stops at a step boundary and reports;
- :mod:`.planning`: every member left has stopped: plan and announce an attempt, or
  wait for joiners when too few ranks are left for the stages;
- :mod:`.agreeing`: every participant acknowledges the attempt; a loss supersedes it;
- :mod:`.applying`: the plan is committed; every participant applies it and the change
  is recorded;
- :mod:`.waiting` and :mod:`.checkpointing`: joiners are awaited; a wait that runs out
  writes a checkpoint and stops the job;
- :mod:`.finishing`: after the change, its redone step and its migration's reports.

Each phase module has ``take(rules, state, change, phase, input, now, out)`` (the input's
effect in that phase) and ``due(rules, state, change, phase, now, out)`` (its timers);
both return the new state and append the actions to ``out``.
"""
