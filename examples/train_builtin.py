"""Train ElasWave's built-in Llama-style model with your own loop, elastically.

    .venv/bin/elaswave run --dp 2 --pp 2 --steps 20 --out runs/builtin examples/train_builtin.py
    .venv/bin/elaswave run --dp 2 --pp 2 --steps 20 --out runs/builtin-kill \\
        --fault kill:1@5:backward examples/train_builtin.py

Without ``model=`` and ``dataset=``, ``elaswave.job()`` trains the job's model (the tiny
built-in decoder unless ``--model`` says otherwise) on the job's data (``--data``, or the
deterministic synthetic corpus). The loop evaluates nothing and checkpoints nothing; its
step hook shows where those go, and every rank prints where it sits after a change.
"""

from __future__ import annotations

import elaswave


def main() -> None:
    job = elaswave.job()
    place = (job.stage, job.replica)
    print(f"rank {job.rank} member {job.tp_rank} trains on {job.device}", flush=True)

    def at_step_end(out) -> None:
        nonlocal place
        if (job.stage, job.replica) != place:  # a layer move or a re-pipelined job
            place = (job.stage, job.replica)
            print(f"rank {job.rank} now at stage {job.stage}, replica {job.replica}", flush=True)
        if out.loss is not None and job.replica == 0 and job.tp_rank == 0 and out.step % 5 == 4:
            print(f"step {out.step}: loss {out.loss:.4f}", flush=True)  # or evaluate, save

    job.on_step_end(at_step_end)
    for _ in job:  # every remaining step; a failure is answered inside it
        pass


if __name__ == "__main__":
    main()
