"""Your training script as an ElasWave worker: ``elaswave run [job flags] SCRIPT [ARGS]``.

``elaswave run`` starts the job host and the Core, then runs SCRIPT in every worker
process (as torchrun does), with ``sys.argv`` set to ``[SCRIPT, *ARGS]``. Inside, the
script takes its place in the job with :func:`job` and trains step by step; a failure,
a slow rank or a joining one is answered inside :meth:`Job.train_step`, in this process,
without a restart::

    import elaswave

    job = elaswave.job(model="hf:path/to/model", dataset=my_token_windows)
    job.on_step_end(lambda out: out.loss is not None and print(out.step, out.loss))
    job.subscribe(print, kinds=[elaswave.EventKind.RECOVERY_FINISHED])
    while not job.done:
        job.train_step()

* ``model``: ``"hf:DIR"`` (a Hugging Face decoder directory) or a preset
  name (``"tiny"``, ElasWave's built-in decoder); ``elaswave run`` reads it from the
  script before it starts the job (the script runs once up to this call, with nothing
  started), so every process, the Core's planners included, knows the model.
* ``dataset``: samples addressed by global sample id: any sequence whose item ``i`` is
  ``seq_len + 1`` token ids (inputs and the next-token targets). The job draws a
  seeded permutation of it per epoch and gives every micro-batch its global ids, so a
  resize or a layer move keeps the global batch and the samples of every step.
* Step boundaries: :meth:`Job.on_step_end` hooks run after every completed step (log,
  evaluate, checkpoint); :meth:`Job.subscribe` and :meth:`Job.events` deliver the
  job's control and recovery events in this process (a callback, or an async iterator).

Outside ``elaswave run``, :func:`job` exits with one line naming the command to use.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from elaswave.runtime.worker.script import installed_loop

if TYPE_CHECKING:
    from elaswave.bus.schema import EventKind
    from elaswave.bus.session import EventStream
    from elaswave.runtime.worker.steploop import StepLoop, StepOutcome

DESCRIBE_ENV = "ELASWAVE_DESCRIBE"
"""Set by ``elaswave run`` for the pass that reads the script's model: the path to write
it to; :func:`job` then writes and exits."""

_job: Job | None = None


def model_source(model: str | None) -> str | None:
    """``model`` as a job's ``--model`` value: ``hf:DIR`` with DIR absolute."""
    if model is None:
        return None
    if not isinstance(model, str) or not model:
        raise ValueError(f"elaswave.job(model={model!r}): expected 'hf:DIR' or a preset name")
    if model.startswith("hf:"):
        return "hf:" + str(Path(model[3:]).resolve())
    return model


class _WindowSource:
    """A user's dataset as the loader's token source, checked item by item."""

    def __init__(self, dataset: Sequence[Any], *, seq_len: int, vocab_size: int) -> None:
        self._data = dataset
        self._seq_len = seq_len
        self._vocab = vocab_size
        if len(dataset) < 1:
            raise ValueError("elaswave.job(dataset=...): the dataset is empty")

    def __len__(self) -> int:
        return len(self._data)

    def window(self, index: int) -> np.ndarray:
        item = self._data[index]
        if hasattr(item, "detach"):
            item = item.detach().cpu().numpy()
        window = np.asarray(item, dtype=np.int64)
        if window.shape != (self._seq_len + 1,):
            raise ValueError(
                f"dataset[{index}] has shape {window.shape}: each sample must be seq_len + 1 "
                f"= {self._seq_len + 1} token ids (inputs and next-token targets)"
            )
        if window.min() < 0 or window.max() >= self._vocab:
            raise ValueError(
                f"dataset[{index}] holds token ids outside [0, {self._vocab}) (the model's vocab)"
            )
        return window


class Job:
    """This process's place in the running job, and its step loop."""

    def __init__(self, loop: StepLoop) -> None:
        self._loop = loop

    @property
    def rank(self) -> int:
        """This process's rank in the plan: with ``--tp N``, its TP group's."""
        return self._loop.rank

    @property
    def tp_rank(self) -> int:
        """This process's member of its TP group (0 without ``--tp``); member 0 speaks
        for the group, so print or save from it only."""
        return self._loop.ctx.member

    @property
    def device(self) -> Any:
        """The ``torch.device`` this process trains on: the one of its host's devices
        the host gave it (``LOCAL_RANK``, as torchrun sets it); put what your step
        adds to the model's work there."""
        return self._loop.ctx.device

    @property
    def stage(self) -> int:
        """This rank's pipeline stage under the current plan (it may change)."""
        return self._loop.place[0]

    @property
    def replica(self) -> int:
        return self._loop.place[1]

    @property
    def world(self) -> int:
        """Ranks in the current plan."""
        return len(self._loop.trainer.plan.ranks)

    @property
    def steps(self) -> int:
        """The job's steps."""
        return self._loop.cfg.schedule.steps

    @property
    def step(self) -> int:
        """The step :meth:`train_step` runs next."""
        return self._loop.step

    @property
    def done(self) -> bool:
        return self._loop.done

    @property
    def global_batch(self) -> int:
        return self._loop.trainer.plan.global_batch

    @property
    def layers(self) -> Any:
        """This rank's layers (an ``nn.ModuleList``; they change with a layer move)."""
        return self._loop.trainer.layers

    def train_step(self) -> StepOutcome:
        """Run the next step, recovering inside it if a failure, a slow rank or a join
        interrupts it; returns the completed step (after a roll-back, an earlier one)."""
        return self._loop.train_step()

    def __iter__(self) -> Iterator[StepOutcome]:
        """Every remaining step's outcome."""
        while not self.done:
            yield self.train_step()

    def on_step_end(self, hook: Callable[[StepOutcome], None]) -> None:
        """Call ``hook(outcome)`` after every completed step, on the training thread."""
        self._loop.hooks.append(hook)

    def subscribe(
        self, callback: Callable[[Any], None], kinds: Iterable[EventKind | str] | None = None
    ) -> Callable[[], None]:
        """Call ``callback(event)`` for the job's control and recovery events of ``kinds``
        (on the bus thread: keep it quick). Returns the unsubscribe function."""
        return self._loop.session.subscribe(callback, kinds)

    def events(self, kinds: Iterable[EventKind | str] | None = None) -> EventStream:
        """An async iterator of the job's control and recovery events, for your loop."""
        return self._loop.session.events(kinds)

    def finish(self) -> None:
        """Write this rank's results (called for you when the script returns)."""
        self._loop.finish()


def job(*, model: str | None = None, dataset: Sequence[Any] | None = None) -> Job:
    """Take this process's place in the job ``elaswave run`` started (see the module
    docstring). Calling it again returns the same :class:`Job`."""
    global _job
    source = model_source(model)
    describe = os.environ.get(DESCRIBE_ENV)
    if describe:
        Path(describe).write_text(json.dumps({"model": source}))
        raise SystemExit(0)
    active = installed_loop()
    if active is None:
        raise SystemExit(  # the user's own script: one line, no traceback
            "elaswave: error: elaswave.job() runs inside an ElasWave job: start this script "
            "with `elaswave run [--dp D --pp P --steps S ...] SCRIPT [ARGS]`"
        )
    if _job is not None and _job._loop is active:
        if dataset is not None:
            raise RuntimeError("elaswave.job() takes the dataset on its first call only")
        return _job
    cfg = active.cfg
    if source is not None and source != (cfg.model.source or "tiny"):
        raise ValueError(
            f"elaswave.job(model={model!r}) is not the job's model "
            f"({cfg.model.source or 'the built-in tiny model'})"
        )
    if dataset is not None:
        if active.step != active.first_step or active.step_times:
            raise RuntimeError("elaswave.job(dataset=...) must come before the first step")
        if cfg.schedule.eval_every and cfg.data.heldout is None:
            raise ValueError(
                f"elaswave.job(dataset=...) with eval_every = {cfg.schedule.eval_every}: "
                "the held-out windows of your dataset are not known; give --eval-data FILE "
                "(a token file, data.heldout)"
            )
        active.ctx.loader.set_source(
            _WindowSource(dataset, seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size)
        )
    _job = Job(active)
    return _job
