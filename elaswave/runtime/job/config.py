"""The job: everything a worker needs to join a run, as frozen dataclasses.

The launcher validates a :class:`JobConfig` once, writes it to RUN_DIR/job.json, and
every worker loads the same file, so all ranks agree on the model, data and layout, and
on the layer costs the planners price (the formulas, or a measured profile). The
training settings are in sections (:mod:`.sections`); job.json holds one object per
section, and a run directory written before sections existed (one flat ``train`` object)
still reads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elaswave import rundir
from elaswave.comm.spec import Device
from elaswave.data.corpus import DataConfig, heldout_path
from elaswave.engine.cost import DeviceSpec, LayerCost, LayerKind, layer_costs
from elaswave.engine.cost import device as cost_device
from elaswave.engine.plan import Plan, initial_plan
from elaswave.engine.rebalance import balanced_counts
from elaswave.engine.recovery import Rebalancing, with_schedule
from elaswave.engine.schedule import ScheduleSetting
from elaswave.fabric.adamw import GradReduceDtype, OptimizerConfig
from elaswave.fabric.remap import FP32_BYTES
from elaswave.model.config import ModelConfig
from elaswave.model.tensor_parallel import check_divisible
from elaswave.runtime.job.faults import StepPhase, validate_faults
from elaswave.runtime.job.sections import (
    FLAT,
    SECTIONS,
    ElasticConfig,
    InjectionConfig,
    LayoutConfig,
    LivenessConfig,
    NetworkConfig,
    Partition,
    Precision,
    ScheduleConfig,
    StateConfig,
    sectioned,
)

EMULATED_DEVICE = "emulated"
"""The cost model's device preset that ``--device emulated`` keeps the time of."""


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """A job: its model, data and optimizer, and its training settings in sections
    (:mod:`~elaswave.runtime.job.sections`), checked together here."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    liveness: LivenessConfig = field(default_factory=LivenessConfig)
    state: StateConfig = field(default_factory=StateConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    injection: InjectionConfig = field(default_factory=InjectionConfig)
    profile: tuple[LayerCost, ...] = ()
    """Measured layer costs (:mod:`elaswave.runtime.host.profile`), priced on
    :attr:`cost_device` at its base clock, one per layer in index order; empty: the cost
    model's formulas."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "profile", tuple(self.profile))
        object.__setattr__(self, "optim", self.optim.for_steps(self.schedule.steps))
        self._check_across_sections()
        self._check_profile()
        tp = self.layout.tp
        if tp > 1:
            m = self.model
            if m.source.startswith("hf:"):
                from elaswave.model.hf import refuse_hf_tp  # imports transformers: only here

                refuse_hf_tp(m, tp)
            check_divisible(
                num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, ffn=m.ffn_hidden_size,
                vocab=m.vocab_size, tp=tp,
            )  # fmt: skip
            if self.profile:
                raise ValueError(
                    f"tp = {tp} with a measured profile: profiling measures whole "
                    "layers; use --profile off with --tp"
                )
        self.plan()  # validates layout against the model and batch

    def _check_across_sections(self) -> None:
        """What one section's settings ask of another's (each section checked its own)."""
        self._check_resume()
        layout, steps = self.layout, self.schedule.steps
        specs = validate_faults(
            self.injection.faults,
            world_size=layout.num_ranks,
            ranks_per_node=layout.ranks_per_node,
            steps=steps,
        )
        schedule = self.schedule.pipeline_schedule
        for spec in specs:
            if spec.phase is StepPhase.WEIGHT and schedule is ScheduleSetting.ONE_F_ONE_B:
                raise ValueError(
                    f"fault {spec}: phase weight is the weight-gradient half of a split "
                    f"backward, which schedule {schedule} has not (train with --schedule "
                    "zb-h1, or name phase backward)"
                )
            if spec.phase is StepPhase.EVAL and not self.schedule.evaluates(spec.step):
                raise ValueError(
                    f"fault {spec}: step {spec.step} does not evaluate (eval_every = "
                    f"{self.schedule.eval_every}: steps K-1, 2K-1, ... and the last do)"
                )
        self._check_eval()

    def _check_resume(self) -> None:
        """What the checkpoint ``--resume`` starts from asks of the job: its tp (each TP
        member's pieces are its own slices of every layer; any dp x pp reads them), and
        steps beyond its own."""
        state, steps = self.state, self.schedule.steps
        if state.resume_tp is not None and state.resume_tp != self.layout.tp:
            raise ValueError(
                f"--resume {state.resume_dir!r}: its checkpoint of step {state.resume_step} "
                f"was written with tp = {state.resume_tp}, not {self.layout.tp}; resume it "
                f"with --tp {state.resume_tp} (any --dp/--pp)"
            )
        resume_step = state.resume_step
        if resume_step is not None and not -1 <= resume_step < steps - 1:
            raise ValueError(
                f"the checkpoint is at step {resume_step}, at or past the last step "
                f"{steps - 1}: raise --steps to train further"
            )

    def _check_eval(self) -> None:
        """Where ``--eval-every`` finds its held-out tokens (recorded in ``data``)."""
        schedule, data = self.schedule, self.data
        if not schedule.eval_every:
            return
        heldout = heldout_path(data)
        if heldout is None and data.path is not None:
            raise ValueError(
                f"eval_every = {schedule.eval_every}: no held-out tokens beside data.path = "
                f"{data.path!r}; give --eval-data FILE (data.heldout)"
            )
        object.__setattr__(self, "data", dataclasses.replace(data, heldout=heldout))

    @property
    def restores_in_job(self) -> bool:
        """Whether lost state is restored from the newest disk checkpoint inside the
        running job: checkpoints are written and restoring is on."""
        return bool(self.state.checkpoint_every) and self.state.restore_in_job

    @property
    def detects_stragglers(self) -> bool:
        """Whether the Core watches for fail-slow ranks (by default: off on cpu)."""
        if self.elastic.straggler_detection is not None:
            return self.elastic.straggler_detection
        return self.layout.device not in (Device.CPU, Device.CPU_STRICT)

    def _check_profile(self) -> None:
        if not self.profile:
            return
        formulas = layer_costs(self.model, tp=self.layout.tp, dtype_bytes=FP32_BYTES)
        if len(self.profile) != len(formulas):
            raise ValueError(
                f"profile has {len(self.profile)} layers; the model has {len(formulas)}: "
                "profile this model again (--profile on)"
            )
        for position, (cost, formula) in enumerate(zip(self.profile, formulas, strict=True)):
            if not isinstance(cost, LayerCost):
                raise ValueError(f"profile[{position}] = {cost!r}: expected a LayerCost")
            if cost.index != position:
                raise ValueError(
                    f"profile[{position}].index = {cost.index!r}: must be {position} "
                    "(one entry per layer, in index order)"
                )
            if cost.kind != formula.kind:
                raise ValueError(
                    f"profile[{position}].kind = {str(cost.kind)!r}: layer {position} is "
                    f"the model's {formula.kind}"
                )
            if cost.params != formula.params:
                raise ValueError(
                    f"profile[{position}].params = {cost.params!r}: layer {position} has "
                    f"{formula.params} parameters"
                )
            for name in (
                "fwd_flops_per_sample",
                "bwd_flops_per_sample",
                "activation_bytes_per_sample",
                "output_bytes_per_sample",
            ):
                value = getattr(cost, name)
                ok = isinstance(value, int | float) and not isinstance(value, bool)
                if not (ok and math.isfinite(value) and value >= 0):
                    raise ValueError(
                        f"profile[{position}].{name} = {value!r}: must be a finite number >= 0"
                    )

    def plan(self) -> Plan:
        layout, schedule = self.layout, self.schedule
        counts = None
        if layout.partition is Partition.BALANCED and layout.pp > 1:
            counts = balanced_counts(
                self.layer_costs,
                dp=layout.dp,
                pp=layout.pp,
                micro_batch=schedule.micro_batch,
                device=self.cost_device,
            )
        choices = schedule.pipeline_schedule.choices
        plan = initial_plan(
            num_layers=self.model.num_layers,
            dp=layout.dp,
            pp=layout.pp,
            global_batch=schedule.global_batch,
            micro_batch=schedule.micro_batch,
            layer_counts=counts,
            schedule=choices[0],
            grain=self.exact_block or 1,
        )
        choosing = Rebalancing(layers=self.layer_costs, device=self.cost_device, schedules=choices)
        return with_schedule(plan, choosing)

    @property
    def cost_device(self) -> DeviceSpec:
        """The device the cost model prices: the emulated one, whose relative layer costs
        also stand in for devices ElasWave has no model of (cpu)."""
        return cost_device(EMULATED_DEVICE)

    @property
    def exact_block(self) -> int | None:
        """Samples computed together, and never split between ranks, under float64
        gradient sums: the job's micro-batch (the plan's grain, the stage runner's
        blocks); None under float32 sums."""
        if self.optim.grad_reduce_dtype is GradReduceDtype.FLOAT64:
            return self.schedule.micro_batch
        return None

    @property
    def power_budget(self) -> float:
        """What DVFS may draw, in plan ranks (TP groups) at the base clock: the launch
        size (dp x pp), so that survivors up-clock only with the power lost ranks freed."""
        return float(self.layout.units)

    @property
    def layer_costs(self) -> list[LayerCost]:
        """What the planners price: the measured :attr:`profile` when there is one, else
        the cost model's formulas at the training precision (activations and what
        crosses stages in bf16 or fp32)."""
        if self.profile:
            return list(self.profile)
        return layer_costs(
            self.model,
            tp=self.layout.tp,
            dtype_bytes=2 if self.schedule.precision is Precision.BF16 else FP32_BYTES,
        )

    def to_dict(self) -> dict[str, Any]:
        """The job as job.json holds it: one object per section."""
        out = dataclasses.asdict(self)
        out["profile"] = [{**c, "kind": str(c["kind"])} for c in out["profile"]]
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> JobConfig:
        """The job from :meth:`to_dict`'s shape, or from the shape of runs before the
        settings had sections: every training setting flat in a ``train`` object."""
        flat = raw.get(FLAT, {})
        if not isinstance(flat, dict):
            raise ValueError(f"{FLAT} = {flat!r}: expected an object of settings")
        values = sectioned(flat)
        for name in SECTIONS:
            values.setdefault(name, {}).update(raw.get(name, {}))
        sections = {name: section(**values[name]) for name, section in SECTIONS.items()}
        return cls(
            model=ModelConfig(**raw.get("model", {})),
            data=DataConfig(**raw.get("data", {})),
            optim=OptimizerConfig(**raw.get("optim", {})),
            **sections,
            profile=_profile_from(raw.get("profile", [])),
        )


def _profile_from(raw: Any) -> tuple[LayerCost, ...]:
    """job.json's ``profile`` list as LayerCosts; ValueError naming a malformed entry."""
    if not isinstance(raw, list | tuple):
        raise ValueError(f"profile = {raw!r}: expected a list of layer costs")
    names = [f.name for f in dataclasses.fields(LayerCost)]
    out = []
    for position, entry in enumerate(raw):
        if not isinstance(entry, dict) or sorted(entry) != sorted(names):
            raise ValueError(
                f"profile[{position}] = {entry!r}: expected an object with keys {', '.join(names)}"
            )
        try:
            kind = LayerKind(entry["kind"])
        except ValueError:
            valid = ", ".join(k.value for k in LayerKind)
            raise ValueError(
                f"profile[{position}].kind = {entry['kind']!r}: valid kinds are {valid}"
            ) from None
        out.append(LayerCost(**{**entry, "kind": kind}))
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class Endpoints:
    """Where a worker finds the Core: the store and the bus broker."""

    store_host: str
    store_port: int
    bus_publish: str
    bus_subscribe: str
    bus_fetch: str = ""
    """The Core's log service, where a worker fetches bus messages it missed."""


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """What RUN_DIR/job.json holds."""

    run_id: str
    config: JobConfig
    endpoints: Endpoints

    def write(self, run_dir: Path, name: str = rundir.JOB) -> None:
        """Write it whole or not at all: readers poll for the file."""
        doc = {
            "run_id": self.run_id,
            "config": self.config.to_dict(),
            "endpoints": dataclasses.asdict(self.endpoints),
        }
        tmp = run_dir / f".{name}.tmp"
        tmp.write_text(json.dumps(doc, indent=2))
        os.replace(tmp, run_dir / name)

    @classmethod
    def read(cls, run_dir: Path, name: str = rundir.JOB) -> JobSpec:
        """RUN_DIR's job; ValueError naming the file when it does not describe a job
        (OSError when it cannot be read)."""
        path = run_dir / name
        try:
            doc = json.loads(path.read_text())
            return cls(
                run_id=doc["run_id"],
                config=JobConfig.from_dict(doc["config"]),
                endpoints=Endpoints(**doc["endpoints"]),
            )
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(
                f"{str(path)!r} does not describe a job ({type(exc).__name__}: {exc})"
            ) from None
