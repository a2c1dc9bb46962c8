"""A randomized fault campaign over real processes: draw a job and 1-4 overlapping faults,
run it and its fault-free twin, and judge the outcome.

    scripts/chaos --cases 300 --seed 1 [--case K[,K...]] [--out /tmp/chaos]
                  [--json FILE] [--md FILE] [--timeout 120] [--keep] [--dry-run]
                  [--tp-weight W]

(``.venv/bin/python scripts/chaos ...`` works too; add --snapshot in a tree others are
editing: every job then runs on one copy of elaswave/ taken at the start, while the
printed commands run the tree as it is.) Cases run one after another; case K
of seed S is drawn from its own generator (``random.Random(f"{S}:{K}")``), so
``--seed S --case K`` reruns exactly that case, and every case line ends with the one
``elaswave train`` command that reproduces it.

The draw
    layout     dp x pp with 2 <= dp*pp <= 8 and pp <= 6 (the tiny model has 6 layers);
               dp = 1 layouts at half weight (any kill stops them)
    nodes      --ranks-per-node 1-3 (at most the world size; need not divide it)
    job        micro batch 1 or 2, two micro-batches per replica (global batch
               2*dp*mb); 10 steps on cpu, 8 on emulated; --seed 0
    faults     1-4 of kill:RANK@STEP:PHASE, kill-node:NODE@STEP:PHASE,
               hang:RANK@STEP:PHASE, slow:RANK=FACTOR@STEP and join@STEP, at steps
               2..steps-2. After the first, a fault's step is, with probability 0.6, that
               of an earlier fault (same, one before or one after): faults overlap. A kill,
               kill-node or hang drawn after a kill, kill-node, hang or join takes, with
               probability 0.3, phase plan or apply at that fault's step (or the next),
               which fires inside the recovery that redoes the step; otherwise phases are
               uniform over forward, backward, grad-sync, snapshot, optimizer. A plan or
               apply fault whose recovery never happens does not fire (the JSON record
               lists which faults fired, from RUN_DIR/faults/).
    policy     --rebalance none, resize, migrate or migrate+dvfs
    waiting    --wait-for-nodes 20 in 30% of cases (drawn last): a job left with fewer
               ranks than stages waits for joiners (its join faults start at once)
    device     cpu (30%), cpu-strict (30%: training traffic under NCCL's rules) or emulated
               (40%: there a slow fault is detected and rebalanced); a seed draws the
               same cases as before cpu-strict was drawn, but for it (one of every two
               earlier cpu cases is a cpu-strict case now)
    timeouts   --heartbeat-timeout 2 (a hang is fenced after 2 s), --plan-ack-timeout 2,
               --comm-timeout 30

Tensor-parallel cases (--tp-weight W, default 0): case K first flips a coin of its own
(``random.Random(f"chaos-tp:{S}:{K}")``, heads with probability W); on tails it is the
case above, exactly as drawn with W = 0 (so W = 0 is every earlier campaign's draw, and
a campaign with W = 0.5 shares its non-TP cases with one at W = 0). On heads, the same
coin's generator draws
    layout     --tp 2 or 4, then dp x pp with dp*pp*tp <= 8 processes (dp*pp = 1
               included: a TP group alone), dp = 1 layouts at half weight
    nodes      --ranks-per-node 1, 2, 4, 6 or 8 that is a divisor or a multiple of tp
               (a TP group spans whole nodes or fits in one), at most the processes
    faults     as above, but kill:P, hang:P and slow:P name process ranks (0 ..
               dp*pp*tp-1: process P is TP member P % tp of plan rank P // tp) and
               kill-node:K the processes K*rpn .. K*rpn+rpn-1; a join adds a whole TP
               group, and joins stop at 12 processes in all (a join past that is drawn
               again)
    job, policy, device, timeouts as above; never --wait-for-nodes (not drawn for TP)
The plan's ranks are then units (TP groups): summary.json's recoveries and the job's
messages name units, so the checks below map every victim process P to its unit
P // tp, and a unit is a victim when any of its processes is.

The end of the apply window (--applied-weight W, default 0): each fault drawn at phase
apply (the start of a plan's apply) moves to phase applied (its end: applied on the
rank, not yet reported to the Core) by a coin of its own generator
(``random.Random(f"chaos-applied:{S}:{K}")``) with chance W.

Held-out evaluation (--eval-every K, default 0): every case and its twin evaluate every
K steps (``--eval-every K``); each optimizer fault at a step that evaluates moves, by a
coin of its own generator (``random.Random(f"chaos-eval:{S}:{K}")``), to phase eval
(inside the evaluation); a recovered case's held-out losses must match the twin's too.

The Core's loss (--core-kill-weight W, default 0): with chance W, by a coin of its own
generator (``random.Random(f"chaos-core:{S}:{K}")``), the case's Core SIGKILLs itself
right after it publishes its first recovery plan, or (the same coin, half the time)
its first commit (``ELASWAVE_CORE_FAULT``); the job host starts another, which restores
from a restore point taken every 2 kB of log (``ELASWAVE_CORE_RESTORE_EVERY``) and
finishes the change. A case without a plan runs as drawn. Every outcome rule holds
unchanged: the Core's loss must not change what the job does.

Many hosts (--hosts-weight W, default 0): with chance W, by a coin of its own generator
(``random.Random(f"chaos-hosts:{S}:{K}")``), a case whose workers fill 2 to 4 nodes of
``--ranks-per-node`` (a tensor-parallel one where each TP group fits in one node: the
job refuses a group across hosts) runs on that many hosts of this machine: node 0's
``elaswave train --nnodes H --rdzv-endpoint 127.0.0.1:PORT`` and an agent for each other
node (``--node-rank N``), all in the case's run directory; the other hosts' workers are
started, signalled and reaped through their agents, and a node fault kills a host's
workers (not its agent). Every outcome rule holds unchanged, every agent must leave
within 20 s of node 0's job, and where that job finished, with status 0.

Model families (--model-weight W, default 0): with chance W, by a coin of its own
generator (``random.Random(f"chaos-model:{S}:{K}")``), the case and its twin train a
tiny Hugging Face family instead of the built-in model (:data:`MODELS`: Llama, Mixtral,
Qwen2-MoE with a shared expert, DeepSeek-V3 with latent attention; 6 pipeline layers,
every width split by tp 2 or 4), written under OUT/seedS/models at the start.

The twin is the same command without --fault (and with the default --rebalance and
--ranks-per-node, which do not change a fault-free run's numerics; with the case's --tp);
twins are cached per (dp, pp, tp, global batch, micro batch, steps, seed, device) under
OUT/seedS/twins.

Outcomes (``ok``: the first four; any other is a failure, and the script exits 1)
    recovered       exit 0, every step done, per-step losses and final parameters (and
                    held-out losses) within 1e-4 (relative) of the twin, ``elaswave
                    replay`` reproduces every announced plan (``replay_run(...).diverged
                    is None``) and the plans are one committed announcement per
                    recovery (as tests/runs.py checks), no worker or Core traceback,
                    and every fail-stop recovery's ranks were fault victims (see
                    below; units when tp > 1)
    stopped-ok      exit 1 with one ``elaswave: job failed: ...`` line that names state
                    that really was lost, and no traceback. "Really lost" is checked
                    against the victims: the ranks with a RUN_DIR/faults/rankN.json record
                    (SIGKILLed by kill or kill-node, or SIGSTOPped by hang, then fenced;
                    with tp > 1, N is a process and the victim is its unit N // tp).
                    Accepted messages: "stage S (...) lost all its ranks [R...]: no
                    replica holds its layers" with every R a victim; "optimizer state
                    lost: ... (owner O, snapshot holder H)" with O and H victims (H may be
                    none); "no worker survives" with every launched rank (unit) a victim.
                    With --checkpoint-every K a lost-state stop also needs the
                    message's "no complete checkpoint of step N or before to restore",
                    and no complete checkpoint of step N - K or before on disk: a job
                    that could restore one must (inside the job)
    stopped-waited  exit 1 after a wait for joiners ran out ("...; stage S (...) lost all
                    its ranks [R...]; waited 20 s for N more ranks to fill every stage,
                    and none came in time (...)"), every R a victim: no state is lost,
                    but no joiner was left to come
    stopped-window  exit 1 for a failure after a plan's commit. A failure there is rolled
                    back (the members go on from what they kept before the plan); only
                    when every member fails on errors of its own while joiners wait
                    does the job stop ("... no member of the plan is left to roll back
                    ..."): a failure of the job, as every outcome below
    mismatch        exit 0 but steps missing, or losses/parameters differ by > 1e-4
    slow-recovery   recovered, but a change took over 15 s (half the comm timeout) beyond
                    its wait for nodes: something waited for a timeout
    replay-diverged replay recomputes a plan differently (or the plans do not match the
                    recoveries)
    traceback       a Python traceback in the job's output, a ``worker.failed`` record
                    whose exception is a programming error (TypeError, KeyError,
                    IndexError, AttributeError, AssertionError, ValueError, ...), a Core
                    failure (``core.failed``, ``core.on_event_failed``), or a message
                    "the Core failed/stopped: ..."
    collateral      the job completed, but a rank that no fault touched failed on the way
                    (a worker.failed record, or a fail-stop recovery of a non-victim; a
                    TP member whose unit is a victim may fail with its group)
    hang            the job ran past --timeout (its whole process group is then killed),
                    or left processes behind after it exited
    unexplained-stop a non-zero exit whose message names no real loss: a rank blamed that
                    no fault touched, a wait that ran out ("did not ... within 30 s"), the
                    Core lost, a stop while pausing for a join or a straggler ("while
                    waiting for every rank to pause at a step boundary"), or no ``job
                    failed`` line
    refused         the CLI refused the drawn job (exit 2): the draw is validated first,
                    so this is a failure of the script or of validation

At the end: a table of cases by fault kind (a case counts once under each kind it has;
"in-recovery" counts plan/apply faults; rows "tp 2" and "tp 4" when there are TP cases)
and outcome, the time per case, and every
failing case's reproduce command. Run directories of passing cases are deleted unless
--keep; failing ones are kept.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4
OK_OUTCOMES = ("recovered", "stopped-ok", "stopped-waited")
WAIT_S = 20.0
"""--wait-for-nodes of the cases that wait for joiners (30% of them)."""
FAIL_OUTCOMES = (
    "stopped-window",
    "mismatch",
    "slow-recovery",
    "replay-diverged",
    "traceback",
    "collateral",
    "hang",
    "unexplained-stop",
    "refused",
)
KINDS = ("kill", "kill-node", "hang", "slow", "join", "in-recovery")
STEP_PHASES = ("forward", "backward", "grad-sync", "snapshot", "optimizer")
POLICIES = ("none", "resize", "migrate", "migrate+dvfs")
DEVICES = ("cpu", "cpu-strict", "emulated")
DEVICE_WEIGHTS = (0.3, 0.3, 0.4)
"""One random() per case, as when cpu (0.6) and emulated (0.4) were drawn: a seed
keeps its cases, and half of its former cpu cases are cpu-strict ones."""
SMOKE = (
    "cli.main",
    "runtime.host.launcher",
    "runtime.core.process",
    "runtime.worker.process",
    "runtime.core.replay",
)
"""Modules a --snapshot must import (a tree caught mid-edit often does not)."""
FIXED = (
    "--heartbeat-timeout", "2", "--plan-ack-timeout", "2", "--comm-timeout", "30",
)  # fmt: skip
SLOW_RECOVERY_S = 15.0
"""The longest a recovered case's change may take, less its wait for nodes: half the
comm timeout. A change that takes longer waited for a timeout (seed 40883, case 4: a
rollback's stop reports behind a torn apply's abandoned wait, 30.4 s); it recovered, but
it is a failure."""
BUG_TYPES = {
    "TypeError",
    "KeyError",
    "IndexError",
    "AttributeError",
    "AssertionError",
    "ValueError",
    "ZeroDivisionError",
    "NameError",
    "UnboundLocalError",
    "NotImplementedError",
    "RecursionError",
    "StopIteration",
    "UnicodeDecodeError",
}
"""Exceptions that mean a bug wherever a worker raises them (a peer's death shows up as
CommError, StepAborted, RuntimeError from gloo, ConnectionError, TimeoutError)."""


# ---------------------------------------------------------------------------- the draw


@dataclass(frozen=True)
class Case:
    seed: int
    index: int
    dp: int
    pp: int
    ranks_per_node: int
    steps: int
    global_batch: int
    micro_batch: int
    faults: tuple[str, ...]
    policy: str
    device: str
    train_seed: int = 0
    wait_for_nodes: float = 0.0
    tp: int = 1
    snapshot_copies: int = 1
    """``--snapshot-copies`` (the campaign's, not drawn: the same seed draws the same
    cases with any number of copies)."""
    max_restarts: int = 0
    """``--max-restarts`` (the campaign's, not drawn): a failed worker whose host is up
    is started again and joins."""
    checkpoint_every: int = 0
    """``--checkpoint-every`` (the campaign's, not drawn, as the copies): lost state is
    then restored from a checkpoint inside the job."""
    schedule: str = "1f1b"
    """``--schedule`` (drawn by :func:`draw_schedule` with a generator of its own)."""
    applied_weight: float = 0.0
    """``--applied-weight`` (the campaign's): :func:`draw_applied` moved each ``apply``
    fault to the end of the apply (``applied``) with this chance."""
    eval_every: int = 0
    """``--eval-every`` (the campaign's, not drawn; the twin evaluates too, and the held-out
    losses must match its): :func:`draw_eval` moves optimizer faults into evaluations."""
    core_kill: str = ""
    """Where the Core SIGKILLs itself: after its first ``plan`` or ``commit`` ("": never;
    drawn by :func:`draw_core_kill`)."""
    hosts: int = 1
    """Hosts the job runs on (drawn by :func:`draw_hosts`): node 0's job host and an
    agent for each other node of ``ranks_per_node`` workers, every one a process of this
    machine on loopback, in one run directory."""
    rdzv_port: int = 0
    """Node 0's store port for the other hosts' agents (a free one, taken at run time)."""
    model: str = ""
    """The Hugging Face family the case trains (one of :data:`MODELS`, drawn by
    :func:`draw_model`); "": the built-in model."""
    model_source: str = ""
    """``hf:DIR`` of :attr:`model`'s directory (written at the campaign's start)."""

    def env(self) -> dict[str, str]:
        """What the case's job adds to the campaign's environment."""
        if not self.core_kill:
            return {}
        from elaswave.runtime.core.supervisor import CORE_FAULT_ENV, CORE_RESTORE_EVERY_ENV

        return {CORE_FAULT_ENV: self.core_kill, CORE_RESTORE_EVERY_ENV: "2048"}

    def evaluates(self, step: int) -> bool:
        """Whether ``step`` ends with a held-out evaluation."""
        every = self.eval_every
        return bool(every) and ((step + 1) % every == 0 or step == self.steps - 1)

    @property
    def world(self) -> int:
        """Plan ranks (units) at the start: TP groups when tp > 1."""
        return self.dp * self.pp

    @property
    def processes(self) -> int:
        """Worker processes at the start: what kill, hang, slow and kill-node target."""
        return self.dp * self.pp * self.tp

    def unit(self, process: int) -> int:
        """The plan rank of process ``process`` (its TP group)."""
        return process // self.tp

    def job_args(self) -> list[str]:
        """The job without faults, policy or node size (what the twin shares)."""
        tp = ["--tp", str(self.tp)] if self.tp > 1 else []
        return [
            "--dp", str(self.dp), "--pp", str(self.pp), *tp, "--steps", str(self.steps),
            "--global-batch", str(self.global_batch), "--micro-batch", str(self.micro_batch),
            "--seed", str(self.train_seed), "--device", self.device, *FIXED,
            "--schedule", self.schedule,  # named even for 1f1b: the default is auto
            *(["--eval-every", str(self.eval_every)] if self.eval_every else []),
            *(["--model", self.model_source] if self.model else []),
            *JOB_FILE,
        ]  # fmt: skip

    def args(self) -> list[str]:
        out = [*self.job_args(), "--ranks-per-node", str(self.ranks_per_node)]
        out += ["--rebalance", self.policy]
        if self.snapshot_copies > 1:
            out += ["--snapshot-copies", str(self.snapshot_copies)]
        if self.checkpoint_every:
            out += ["--checkpoint-every", str(self.checkpoint_every)]
        if self.max_restarts:
            out += ["--max-restarts", str(self.max_restarts)]
        if self.wait_for_nodes:
            out += ["--wait-for-nodes", f"{self.wait_for_nodes:g}"]
        for fault in self.faults:
            out += ["--fault", fault]
        if self.hosts > 1:
            out += ["--nnodes", str(self.hosts), "--rdzv-endpoint", self.rdzv]
        return out

    @property
    def rdzv(self) -> str:
        return f"127.0.0.1:{self.rdzv_port}"

    def agent_args(self) -> list[list[str]]:
        """The ``elaswave train`` arguments of the other hosts' agents."""
        return [
            ["--nnodes", str(self.hosts), "--node-rank", str(node), "--nproc-per-node",
             str(self.ranks_per_node), "--rdzv-endpoint", self.rdzv]
            for node in range(1, self.hosts)
        ]  # fmt: skip

    def twin_key(self) -> str:
        return (
            f"dp{self.dp}_pp{self.pp}" + (f"_tp{self.tp}" if self.tp > 1 else "")
            + f"_gb{self.global_batch}_mb{self.micro_batch}"
            f"_s{self.steps}_seed{self.train_seed}_{self.device}"
            + (f"_{self.schedule}" if self.schedule != "1f1b" else "")
            + (f"_eval{self.eval_every}" if self.eval_every else "")
            + (f"_{self.model}" if self.model else "")
        )  # fmt: skip

    def describe(self) -> str:
        return (
            f"dp={self.dp}xpp={self.pp}"
            + (f"xtp={self.tp}" if self.tp > 1 else "")
            + f" rpn={self.ranks_per_node} gb={self.global_batch} "
            f"mb={self.micro_batch} steps={self.steps} faults=[{', '.join(self.faults)}] "
            f"policy={self.policy} device={self.device}"
            + (f" wait={self.wait_for_nodes:g}" if self.wait_for_nodes else "")
            + (f" copies={self.snapshot_copies}" if self.snapshot_copies > 1 else "")
            + (f" checkpoint-every={self.checkpoint_every}" if self.checkpoint_every else "")
            + (f" max-restarts={self.max_restarts}" if self.max_restarts else "")
            + (f" schedule={self.schedule}" if self.schedule != "1f1b" else "")
            + (f" eval-every={self.eval_every}" if self.eval_every else "")
            + (f" core-killed-after={self.core_kill}" if self.core_kill else "")
            + (f" hosts={self.hosts}" if self.hosts > 1 else "")
            + (f" model={self.model}" if self.model else "")
        )


def draw_schedule(case: Case, weight: float, schedule: str = "zb-h1") -> Case:
    """``case`` under ``schedule`` with chance ``weight`` (a generator of its own: the
    rest of the case is what every weight draws). Under ZB-H1 its ``backward`` faults
    are then moved to the weight-gradient half (``weight``) by a coin each; under
    ``auto`` (the planner chooses the schedule, and with migrate policies the layers and
    clocks under each) they stay where they are, as auto may choose 1F1B."""
    if weight <= 0:
        return case
    rng = random.Random(f"chaos-schedule:{case.seed}:{case.index}")
    if rng.random() >= weight:
        return case
    if schedule == "auto":
        return replace(case, schedule="auto")
    faults = tuple(
        f[: -len("backward")] + "weight" if f.endswith(":backward") and rng.random() < 0.5 else f
        for f in case.faults
    )
    return replace(case, schedule="zb-h1", faults=faults)


def draw_core_kill(case: Case, weight: float) -> Case:
    """``case`` with its Core killed after its first plan or commit, with chance
    ``weight`` (a generator of its own: the rest of the draw is what any weight draws)."""
    if weight <= 0:
        return case
    rng = random.Random(f"chaos-core:{case.seed}:{case.index}")
    if rng.random() >= weight:
        return case
    return replace(case, core_kill=rng.choice(("plan", "commit")))


MODEL_SHAPE: dict[str, object] = dict(
    vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
    tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
"""The Hugging Face families' shape: the built-in model's 6 pipeline layers, and every
width a tp of 2 or 4 divides."""
MODELS: dict[str, tuple[str, dict[str, object]]] = {
    "llama": ("llama", {}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2-moe": ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 48,
                                "shared_expert_intermediate_size": 96,
                                "mlp_only_layers": [1]}),
    "deepseek-v3": ("deepseek_v3", {"n_routed_experts": 4, "num_experts_per_tok": 2,
                                    "moe_intermediate_size": 48, "first_k_dense_replace": 1,
                                    "q_lora_rank": 32, "kv_lora_rank": 16,
                                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                                    "v_head_dim": 16, "n_group": 1, "topk_group": 1}),
}  # fmt: skip
"""What ``--model-weight`` draws: a dense decoder, a mixture of experts, one with a
shared expert and a dense block among its expert ones, and one with latent attention
and a dense first block (config.json only: seeded initialisation)."""


def write_models(root: Path) -> dict[str, str]:
    """Each of :data:`MODELS` as a model directory under ROOT/models: family -> hf:DIR."""
    import transformers

    sources = {}
    for family, (model_type, own) in MODELS.items():
        directory = root / "models" / family
        if not (directory / "config.json").is_file():
            config = transformers.AutoConfig.for_model(model_type, **{**MODEL_SHAPE, **own})
            config.save_pretrained(directory)
        sources[family] = f"hf:{directory}"
    return sources


def draw_model(case: Case, weight: float, sources: dict[str, str]) -> Case:
    """``case`` training one of :data:`MODELS` (``sources``: their directories) with
    chance ``weight`` (a generator of its own: the rest of the draw is what any weight
    draws)."""
    if weight <= 0:
        return case
    rng = random.Random(f"chaos-model:{case.seed}:{case.index}")
    if rng.random() >= weight:
        return case
    family = rng.choice(sorted(MODELS))
    return replace(case, model=family, model_source=sources[family])


MAX_HOSTS = 4
"""The most hosts a case runs on (each an agent and a zygote beside its workers)."""


def draw_hosts(case: Case, weight: float) -> Case:
    """``case`` on ``processes / ranks_per_node`` hosts of this machine, with chance
    ``weight`` where that is 2 to :data:`MAX_HOSTS` (a generator of its own: the rest of
    the draw is what any weight draws). Its node faults then kill a host's workers, not
    its agent; a joiner starts on a host that asked for work or on node 0. A
    tensor-parallel case goes to several hosts where its TP groups fit in one host
    each (the job refuses a group across hosts)."""
    if weight <= 0:
        return case
    rng = random.Random(f"chaos-hosts:{case.seed}:{case.index}")
    hosts, rest = divmod(case.processes, case.ranks_per_node)
    if rng.random() >= weight or rest or not 2 <= hosts <= MAX_HOSTS:
        return case
    if case.ranks_per_node % case.tp:  # refused: a TP group across hosts
        return case
    return replace(case, hosts=hosts)


def draw_applied(case: Case, weight: float) -> Case:
    """``case`` with each fault at phase ``apply`` (the start of a plan's apply) moved to
    ``applied`` (its end: applied on the rank, not yet reported to the Core) by a coin of
    its own generator with chance ``weight``; the rest of the draw is what any weight
    draws."""
    if weight <= 0:
        return case
    rng = random.Random(f"chaos-applied:{case.seed}:{case.index}")

    def moved(fault: str) -> str:
        if fault.endswith(":apply") and rng.random() < weight:
            return fault.removesuffix(":apply") + ":applied"
        return fault

    return replace(case, faults=tuple(moved(f) for f in case.faults), applied_weight=weight)


def draw_eval(case: Case, every: int) -> Case:
    """``case`` evaluating every ``every`` steps (0: as it is), each of its faults at phase
    ``optimizer`` of a step that evaluates moved, by a coin of its own generator, to the
    evaluation (``eval``); the rest of the draw is what any ``every`` draws."""
    if every <= 0:
        return case
    case = replace(case, eval_every=every)
    rng = random.Random(f"chaos-eval:{case.seed}:{case.index}")

    def moved(fault: str) -> str:
        what, _, at = fault.partition("@")  # join@STEP and slow:R=F@STEP have no phase
        step, _, phase = at.partition(":")
        if phase == "optimizer" and case.evaluates(int(step)) and rng.random() < 0.5:
            return f"{what}@{step}:eval"
        return fault

    return replace(case, faults=tuple(moved(f) for f in case.faults))


def _layouts() -> list[tuple[int, int]]:
    return [(dp, pp) for dp in range(1, 9) for pp in range(1, 7) if 2 <= dp * pp <= 8]


def draw_case(seed: int, index: int, tp_weight: float = 0.0) -> Case:
    """Case ``index`` of campaign ``seed``: a function of the two (and of ``tp_weight``,
    the chance that it is a tensor-parallel case). A case that does not draw tp is the
    case every ``tp_weight`` draws, 0 included: the TP coin has a generator of its own."""
    if tp_weight > 0:
        tp_rng = random.Random(f"chaos-tp:{seed}:{index}")
        if tp_rng.random() < tp_weight:
            for _ in range(100):
                case = _draw_tp(tp_rng, seed, index)
                if _valid(case):
                    return case
            raise RuntimeError(f"could not draw a valid TP case {index} of seed {seed}")
    rng = random.Random(f"chaos:{seed}:{index}")
    for _ in range(100):
        case = _draw(rng, seed, index)
        if _valid(case):
            return case
    raise RuntimeError(f"could not draw a valid case {index} of seed {seed}")


def _draw(rng: random.Random, seed: int, index: int) -> Case:
    layouts = _layouts()
    dp, pp = rng.choices(layouts, weights=[1 if dp == 1 else 2 for dp, _ in layouts])[0]
    world = dp * pp
    rpn = rng.randint(1, min(3, world))
    device = rng.choices(DEVICES, weights=DEVICE_WEIGHTS)[0]
    steps = 8 if device == "emulated" else 10
    mb = rng.choice([1, 2])
    nodes = -(-world // rpn)
    count = rng.choices([1, 2, 3, 4], weights=[0.3, 0.3, 0.25, 0.15])[0]
    faults = _draw_faults(rng, count, steps, world, nodes)
    return Case(
        seed=seed,
        index=index,
        dp=dp,
        pp=pp,
        ranks_per_node=rpn,
        steps=steps,
        global_batch=2 * dp * mb,
        micro_batch=mb,
        faults=faults,
        policy=rng.choice(POLICIES),
        device=device,
        wait_for_nodes=WAIT_S if rng.random() < 0.3 else 0.0,  # drawn last: older
    )  # campaigns draw the same cases but for it


TP_SIZES = (2, 4)
"""The tensor-parallel sizes a TP case draws (the tiny model has 4 heads)."""
TP_MAX_PROCESSES = 8
"""dp x pp x tp of a TP case at the start."""
TP_MAX_WITH_JOINS = 12
"""Processes a TP case may reach with its joiners (each join adds a whole TP group)."""


def _draw_tp(rng: random.Random, seed: int, index: int) -> Case:
    """A tensor-parallel case: tp 2 or 4, dp x pp x tp <= 8 processes, ranks per node a
    divisor or a multiple of tp, no wait for joiners; faults target process ranks."""
    tp = rng.choice(TP_SIZES)
    layouts = [
        (dp, pp) for dp in range(1, 9) for pp in range(1, 7) if dp * pp * tp <= TP_MAX_PROCESSES
    ]
    dp, pp = rng.choices(layouts, weights=[1 if dp == 1 else 2 for dp, _ in layouts])[0]
    processes = dp * pp * tp
    rpn = rng.choice(
        [r for r in (1, 2, 4, 6, 8) if r <= processes and (r % tp == 0 or tp % r == 0)]
    )
    device = rng.choices(DEVICES, weights=DEVICE_WEIGHTS)[0]
    steps = 8 if device == "emulated" else 10
    mb = rng.choice([1, 2])
    nodes = -(-processes // rpn)
    count = rng.choices([1, 2, 3, 4], weights=[0.3, 0.3, 0.25, 0.15])[0]
    joins = (TP_MAX_WITH_JOINS - processes) // tp
    faults = _draw_faults(rng, count, steps, processes, nodes, max_joins=joins)
    return Case(
        seed=seed,
        index=index,
        dp=dp,
        pp=pp,
        tp=tp,
        ranks_per_node=rpn,
        steps=steps,
        global_batch=2 * dp * mb,
        micro_batch=mb,
        faults=faults,
        policy=rng.choice(POLICIES),
        device=device,
    )


def _draw_faults(
    rng: random.Random,
    count: int,
    steps: int,
    world: int,
    nodes: int,
    max_joins: int | None = None,
) -> tuple[str, ...]:
    """``count`` faults over processes ``0 .. world - 1`` on ``nodes`` nodes (at most
    ``max_joins`` joins when given: a join drawn past it is drawn again)."""
    faults: list[str] = []
    drawn: list[tuple[str, int]] = []  # (kind, step) of each fault so far
    while len(faults) < count:
        kind = rng.choices(
            ["kill", "kill-node", "hang", "slow", "join"], weights=[35, 15, 15, 15, 20]
        )[0]
        if (
            kind == "join"
            and max_joins is not None
            and sum(k == "join" for k, _ in drawn) >= max_joins
        ):
            continue
        if drawn and rng.random() < 0.6:
            step = rng.choice(drawn)[1] + rng.choice([0, 0, -1, 1])
        else:
            step = rng.randint(2, steps - 2)
        step = min(max(step, 2), steps - 2)
        if kind == "join":
            fault = f"join@{step}"
        elif kind == "slow":
            factor = rng.choice([1.5, 2, 3, 4])
            fault = f"slow:{rng.randrange(world)}={factor:g}@{step}"
        else:
            anchors = [(k, s) for k, s in drawn if k in ("kill", "kill-node", "hang", "join")]
            if anchors and rng.random() < 0.3:
                phase = rng.choice(["plan", "apply"])
                step = min(rng.choice(anchors)[1] + rng.choice([0, 0, 1]), steps - 2)
            else:
                phase = rng.choice(STEP_PHASES)
            if kind == "kill-node":
                target = rng.randrange(nodes)
            else:  # a rank killed or stopped once stays so: target another
                taken = {
                    int(f.split(":")[1].split("@")[0])
                    for f in faults
                    if f.startswith(("kill:", "hang:"))
                }
                free = [r for r in range(world) if r not in taken]
                target = rng.choice(free or list(range(world)))
            fault = f"{kind}:{target}@{step}:{phase}"
        if fault in faults:
            continue
        faults.append(fault)
        drawn.append((kind, step))
    return tuple(faults)


def _valid(case: Case) -> bool:
    """What ``elaswave train`` would accept (the config's own validation)."""
    from elaswave.runtime.job.config import JobConfig
    from elaswave.runtime.job.sections import (
        ElasticConfig,
        InjectionConfig,
        LayoutConfig,
        ScheduleConfig,
    )

    try:
        JobConfig(
            layout=LayoutConfig(
                dp=case.dp,
                pp=case.pp,
                tp=case.tp,
                device=case.device,
                ranks_per_node=case.ranks_per_node,
            ),
            schedule=ScheduleConfig(
                steps=case.steps, global_batch=case.global_batch, micro_batch=case.micro_batch
            ),
            elastic=ElasticConfig(
                rebalance=case.policy,
                wait_for_nodes_s=case.wait_for_nodes if case.tp > 1 else 0.0,
            ),
            injection=InjectionConfig(faults=case.faults),
        )
    except ValueError:
        return False
    return True


# ----------------------------------------------------------------------------- running


@dataclass
class Job:
    out: Path
    code: int | None
    """Exit status; None when it ran past the timeout (then killed)."""
    stdout: str
    stderr: str
    wall_s: float
    leftovers: list[int] = field(default_factory=list)
    """Processes of the job's session still alive after it exited."""
    agents: list[int | None] = field(default_factory=list)
    """The other hosts' agents' exit statuses (None: still running :data:`AGENT_GRACE_S`
    after node 0's job ended, then killed)."""


def command(out: Path, args: list[str], env: dict[str, str] | None = None) -> str:
    """The shell command of a job (``env``: the variables it sets first)."""
    assigned = [f"{name}={value}" for name, value in (env or {}).items()]
    return shlex.join([*assigned, ".venv/bin/elaswave", "train", "--out", str(out), *args])


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if len(fields) > 3 and int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


JOB_ENV: dict[str, str] | None = None
"""The jobs' environment: None (inherit), or with PYTHONPATH on a --snapshot copy."""
JOB_CWD = ROOT
JOB_FILE: list[str] = []
"""``--config FILE`` for every case and twin (the campaign's ``--config``), or nothing."""
"""Where jobs start (outside the tree with --snapshot, so the copy is what imports)."""


def take_snapshot(root: Path) -> tuple[Path, str]:
    """Copy the tree's elaswave/ under ``root``/code; (its directory, a digest of it)."""
    code = root / "code"
    shutil.rmtree(code, ignore_errors=True)
    shutil.copytree(
        ROOT / "elaswave", code / "elaswave", ignore=shutil.ignore_patterns("__pycache__")
    )
    digest = hashlib.sha256()
    for path in sorted((code / "elaswave").rglob("*.py")):
        digest.update(str(path.relative_to(code)).encode() + b"\0" + path.read_bytes())
    return code, digest.hexdigest()[:16]


AGENT_GRACE_S = 20.0
"""How long the other hosts' agents may take to leave after node 0's job ends."""


def run_job(
    out: Path,
    args: list[str],
    timeout: float,
    env: dict[str, str] | None = None,
    agents: list[list[str]] | None = None,
) -> Job:
    """Run ``elaswave train`` to its end (or the timeout); ``env``: added to the
    campaign's environment; ``agents``: the other hosts' ``elaswave train`` arguments
    (their output beside the run directory, OUT.nodeN.log)."""
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "elaswave.cli.main", "train", "--out", str(out), *args]
    started = time.monotonic()
    job_env = {**(JOB_ENV or os.environ), **env} if env else JOB_ENV
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=JOB_CWD,
        env=job_env,
    )
    hosts = [_start_agent(out, node, argv, job_env) for node, argv in enumerate(agents or [], 1)]
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        code = None
    wall = time.monotonic() - started
    leftovers: list[int] = []
    if code is not None:
        deadline = time.monotonic() + 3.0
        while (leftovers := _session_pids(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of it
    return Job(out, code, stdout, stderr, wall, leftovers, [_end_agent(a) for a in hosts])


def _start_agent(
    out: Path, node: int, argv: list[str], env: dict[str, str] | None
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "elaswave.cli.main", "train", "--out", str(out), *argv]
    with (out.parent / f"{out.name}.node{node}.log").open("wb") as log:
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=JOB_CWD,
            env=env,
        )  # fmt: skip


def _end_agent(agent: subprocess.Popen[bytes]) -> int | None:
    """An agent's exit status, once node 0's job has ended (None: it did not leave
    within :data:`AGENT_GRACE_S`, and was killed with its workers)."""
    try:
        code: int | None = agent.wait(AGENT_GRACE_S)
    except subprocess.TimeoutExpired:
        code = None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(agent.pid, signal.SIGKILL)
    agent.wait()
    return code


# ---------------------------------------------------------------------------- judging


@dataclass
class Verdict:
    outcome: str
    detail: str = ""
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome in OK_OUTCOMES


def victims(run_dir: Path) -> dict[int, str]:
    """process rank -> the fault that SIGKILLed or SIGSTOPped it
    (RUN_DIR/faults/rankN.json; with tp > 1, N is a process rank, not a plan rank)."""
    out = {}
    for path in sorted((run_dir / "faults").glob("rank*.json")):
        if not path.stem[4:].isdigit():
            continue
        # A record can be empty: a node's ranks that reach a kill-node together race, and
        # one can be SIGKILLed while writing its own. The file still names the victim.
        out[int(path.stem[4:])] = "?"
        with contextlib.suppress(OSError, ValueError, KeyError):
            out[int(path.stem[4:])] = str(json.loads(path.read_text())["fault"])
    return out


def _exc_type(trace: str) -> str:
    lines = [ln for ln in trace.strip().splitlines() if ln and not ln.startswith(" ")]
    if not lines:
        return "?"
    return lines[-1].split(":", 1)[0].rsplit(".", 1)[-1].strip()


@dataclass
class LogFindings:
    bugs: list[str] = field(default_factory=list)
    """Programming errors: 'logs/rank3.log: TypeError: ... (at file:line in func)'."""
    peer_errors: dict[int, str] = field(default_factory=dict)
    """rank -> its worker.failed error of a non-bug kind (a peer's death, a timeout)."""


def _where(trace: str) -> str:
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', trace)
    if not frames:
        return ""
    elaswave = [f for f in frames if "/elaswave/" in f[0]] or frames
    path, line, func = elaswave[-1]
    path = path.split("/elaswave/", 1)[-1]
    return f" (raised at elaswave/{path}:{line} in {func})"


def scan_logs(job: Job) -> LogFindings:
    found = LogFindings()
    for text, name in ((job.stdout, "stdout"), (job.stderr, "stderr")):
        if "Traceback (most recent call last)" in text:
            tail = text[text.index("Traceback (most recent call last)") :]
            found.bugs.append(f"{name}: {_exc_type(tail)}{_where(tail)}")
        for line in text.splitlines():
            if '"host.on_event_failed"' in line or '"core.on_event_failed"' in line:
                found.bugs.append(f"{name}: {line[:300]}")
    for path in sorted((job.out / "logs").glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                if "Traceback (most recent call last)" in line:
                    found.bugs.append(f"logs/{path.name}: a traceback outside the JSON log")
                continue
            if not isinstance(doc, dict):
                continue
            event = doc.get("event")
            trace = str(doc.get("traceback") or doc.get("exception") or "")
            if event == "worker.failed":
                kind = _exc_type(trace)
                what = f"{kind}: {doc.get('error', '')}"
                if kind in BUG_TYPES:
                    found.bugs.append(f"logs/{path.name}: {what}{_where(trace)}")
                else:
                    rank = int(re.sub(r"\D", "", path.stem) or -1)
                    found.peer_errors[rank] = f"{what}{_where(trace)}"
            elif event in ("core.failed", "core.on_event_failed", "host.on_event_failed") or (
                trace and event != "worker.failed"
            ):
                kind = _exc_type(trace) if trace else str(doc.get("error", ""))
                found.bugs.append(f"logs/{path.name}: {event}: {kind}{_where(trace)}")
    return found


def _ranks(text: str) -> list[int]:
    return [int(r) for r in re.findall(r"\d+", text)]


def victim_units(case: Case, hit: dict[int, str]) -> set[int]:
    """The plan ranks (units) among the victims: a TP group is one when any of its
    processes is (process P is in unit P // tp)."""
    return {case.unit(p) for p in hit}


def judge_stop(case: Case, job: Job, hit: set[int]) -> Verdict:
    """``hit``: the victim units (the job's messages name plan ranks). A stop for lost
    state is acceptable only when no checkpoint could be restored (:func:`_unrestored`)."""
    verdict = _judge_stop(case, job, hit)
    if verdict.outcome == "stopped-ok" and "no worker survives" not in job.stderr:
        return _unrestored(case, job, verdict)
    return verdict


def _unrestored(case: Case, job: Job, verdict: Verdict) -> Verdict:
    """A lost-state stop of a job that writes checkpoints is acceptable when its message
    says no checkpoint was complete at the survivors' step N, and the disk agrees: none
    of step N - K or before (one period earlier: complete before the failure, whatever a
    writer did after) is complete (for a TP job, every member's slices)."""
    if not case.checkpoint_every:
        return verdict
    from elaswave.fabric.checkpoint import complete_steps
    from elaswave.runtime.job.config import JobSpec

    said = re.search(r"no complete checkpoint of step (-?\d+) or before to restore", job.stderr)
    if said is None:
        return Verdict("unexplained-stop", verdict.detail, "state was lost, and no restore tried")
    layers = JobSpec.read(job.out).config.model.num_layers
    older = sorted(
        s
        for s in complete_steps(job.out, layers, tp=case.tp)
        if s <= int(said[1]) - case.checkpoint_every
    )
    if older:
        return Verdict("unexplained-stop", verdict.detail, f"checkpoints {older} were complete")
    return verdict


RESUME_HINT = re.compile(
    r"; (resume from the checkpoint of step -?\d+ with --resume \S+"
    r"|it wrote no complete checkpoint \(train with --checkpoint-every K to resume\))$"
)
"""What a stop message appends to its reason when the run directory holds a complete
checkpoint (or that it holds none): how to continue the job, not why it stopped."""


def _judge_stop(case: Case, job: Job, hit: set[int]) -> Verdict:
    lines = [ln for ln in job.stderr.splitlines() if ln.startswith("elaswave: job failed: ")]
    if job.code != 1 or len(lines) != 1:
        tail = job.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
        return Verdict("unexplained-stop", f"exit {job.code}, no single 'job failed' line: "
                       f"{tail[0][:300]}")  # fmt: skip
    said = lines[0].removeprefix("elaswave: job failed: ")
    short = said if len(said) < 400 else said[:400] + "..."
    msg = RESUME_HINT.sub("", said)  # how to go on, after the reason
    if msg.startswith(("the Core failed", "the Core stopped")):
        return Verdict("traceback", short)
    unknown = lambda ranks: sorted(set(ranks) - set(hit))  # noqa: E731
    if "while waiting for every rank to pause at a step boundary" in msg:
        return Verdict(
            "unexplained-stop",
            short,
            "a failure during a join's or straggler's pause stopped the job",
        )
    if "no member of the plan is left to roll back" in msg:
        why = "a failure in the apply window was not rolled back"
        return Verdict("stopped-window", short, why)
    if "to fill every stage, and none came in time" in msg:
        stages = re.findall(r"stage \d+ \(layers [^)]*\) lost all its ranks \[([\d, ]+)\]", msg)
        bad = unknown([r for ranks in stages for r in _ranks(ranks)])
        if stages and not bad:
            return Verdict("stopped-waited", short)
        return Verdict("unexplained-stop", short, f"ranks {bad} were not fault victims")
    if re.search(r"ranks \[[\d, ]*\] did not [^;]* within [\d.]+ s", msg):
        return Verdict("unexplained-stop", short, "a wait ran out")
    if "the Core was lost" in msg:
        return Verdict("unexplained-stop", short, "the Core was lost")
    if msg.endswith("no worker survives"):
        left = sorted(set(range(case.world)) - set(hit))
        if not left:
            return Verdict("stopped-ok", short)
        return Verdict("unexplained-stop", short, f"ranks {left} were never fault victims")
    stage = re.search(r"stage \d+ \(layers [^)]*\) lost all its ranks \[([\d, ]+)\]", msg)
    if stage:
        bad = unknown(_ranks(stage[1]))
        if not bad:
            return Verdict("stopped-ok", short)
        return Verdict("unexplained-stop", short, f"ranks {bad} were not fault victims")
    if "optimizer state lost" in msg:
        pairs = re.findall(r"owner (\d+), snapshot holders? \[?([\d, ]+|none)\]?", msg)
        named = [int(x) for o, hs in pairs for x in (o, *re.findall(r"\d+", hs))]
        bad = unknown(named)
        if pairs and not bad:
            return Verdict("stopped-ok", short)
        return Verdict("unexplained-stop", short, f"ranks {bad} were not fault victims")
    return Verdict("unexplained-stop", short, "the message names no lost state")


def judge(case: Case, job: Job, twin: Path | None) -> Verdict:
    from elaswave.runtime.core.compare import compare_runs
    from elaswave.runtime.core.replay import replay_run
    from elaswave.runtime.job.results import read_summary

    if job.code is None:
        return Verdict("hang", f"still running after {job.wall_s:.0f} s; killed")
    if job.leftovers:
        return Verdict("hang", f"processes {job.leftovers} outlived the job")
    if stuck := [node for node, code in enumerate(job.agents, 1) if code is None]:
        return Verdict(
            "hang", f"the agents of nodes {stuck} outlived the job by {AGENT_GRACE_S:g} s"
        )
    failed = {node: code for node, code in enumerate(job.agents, 1) if code != 0}
    if job.code == 0 and failed:
        return Verdict("mismatch", f"the job finished, but its agents exited {failed}")
    if job.code == 2:
        return Verdict("refused", job.stderr.strip()[-300:])
    hit = victim_units(case, victims(job.out))
    logs = scan_logs(job)
    if logs.bugs:
        return Verdict("traceback", "; ".join(logs.bugs[:3]))
    replay_problem = ""
    try:
        replayed = replay_run(job.out)
    except ValueError as exc:
        replayed = None
        replay_problem = str(exc) if job.code == 0 else ""
    if replayed is not None and replayed.diverged is not None:
        d = replayed.diverged
        replay_problem = (
            f"generation {d.generation} attempt {d.attempt}: {'; '.join(d.problems)} "
            f"(cause: {d.cause})"
        )
    if job.code != 0:
        verdict = judge_stop(case, job, hit)
        if verdict.ok and replay_problem:
            return Verdict("replay-diverged", replay_problem, verdict.detail)
        return verdict
    # A TP member that fails on its group's loss (a partner killed or stopped) goes with
    # its unit, which was a victim: that is no collateral.
    strays = {r: e for r, e in logs.peer_errors.items() if case.tp == 1 or case.unit(r) not in hit}
    if strays:
        what = "process" if case.tp > 1 else "rank"
        return Verdict(
            "collateral",
            "; ".join(f"{what} {r}: {e}" for r, e in sorted(strays.items())),
        )
    summary = read_summary(job.out)
    if summary.steps_completed != case.steps or len(summary.loss) != case.steps:
        return Verdict("mismatch", f"{summary.steps_completed} of {case.steps} steps")
    strangers = sorted(
        {r for rec in summary.recoveries if rec.kind == "fail-stop" for r in rec.ranks} - set(hit)
    )
    if strangers:
        return Verdict("collateral", f"recovered around ranks {strangers}, no fault's victims")
    if replay_problem:
        return Verdict("replay-diverged", replay_problem)
    assert replayed is not None
    want = [
        (r.generation, attempt) for r in summary.recoveries for attempt in range(r.superseded + 1)
    ]
    got = [(p.generation, p.attempt) for p in replayed.plans]
    if got != want:
        return Verdict("replay-diverged", f"replayed plans {got}, recoveries say {want}")
    assert twin is not None
    try:
        diff = compare_runs(job.out, twin)
    except ValueError as exc:  # e.g. held-out losses of other steps than the twin's
        return Verdict("mismatch", str(exc))
    if not (diff.loss_rel <= TOL and diff.param_rel <= TOL and diff.eval_rel <= TOL):
        return Verdict(
            "mismatch",
            f"loss {diff.loss_rel:.2e}, params {diff.param_rel:.2e}, held-out loss "
            f"{diff.eval_rel:.2e} rel. to the twin",
        )
    slow = [
        (r.generation, round(r.mttr_s - (r.waited_s or 0.0), 1))
        for r in summary.recoveries
        if r.mttr_s - (r.waited_s or 0.0) > SLOW_RECOVERY_S
    ]
    if slow:
        return Verdict(
            "slow-recovery",
            f"changes (generation, seconds not waiting for nodes) {slow}: over "
            f"{SLOW_RECOVERY_S:g} s, half the comm timeout (something waited for a timeout)",
        )
    kinds = [str(r.kind) for r in summary.recoveries]
    return Verdict(
        "recovered",
        f"recoveries {kinds}; loss {diff.loss_rel:.0e}, params {diff.param_rel:.0e}",
    )


# ------------------------------------------------------------------------------ campaign


def ensure_twin(case: Case, root: Path, timeout: float) -> tuple[Path | None, str]:
    """The fault-free run of the case's job (cached); (None, why) if it failed."""
    out = root / "twins" / case.twin_key()
    if (out / "summary.json").is_file() and (out / "params").is_dir():
        return out, ""
    job = run_job(out, case.job_args(), timeout)
    if job.code != 0:
        tail = (job.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"the fault-free twin failed (exit {job.code}): {tail[:300]}"
    return out, ""


def run_case(case: Case, root: Path, timeout: float, keep: bool, tp_weight: float = 0.0) -> dict:
    out = root / f"case{case.index:04d}"
    if case.hosts > 1:
        case = replace(case, rdzv_port=_free_port())
    cmd = command(out, case.args(), case.env())
    for node, argv in enumerate(case.agent_args(), 1):
        cmd += f"  &  (node {node}) " + command(out, argv)
    job = run_job(out, case.args(), timeout, case.env(), case.agent_args())
    twin: Path | None = None
    twin_s = 0.0
    if job.code == 0:
        started = time.monotonic()
        twin, why = ensure_twin(case, root, timeout)
        twin_s = time.monotonic() - started
        if twin is None:
            verdict = Verdict("mismatch", why)
    if job.code != 0 or twin is not None:
        try:
            verdict = judge(case, job, twin)
        except Exception as exc:  # a run too broken to read is a finding, not a crash
            verdict = Verdict("mismatch", f"could not judge: {type(exc).__name__}: {exc}")
    fired = victims(out)
    units = sorted(victim_units(case, fired))
    cores = len(list((out / "logs").glob("core*.log")))  # the Core's incarnations
    record = {
        "case": case.index,
        "seed": case.seed,
        **{k: v for k, v in asdict(case).items() if k not in ("seed", "index")},
        "faults": list(case.faults),
        "victims": {str(r): f for r, f in sorted(fired.items())},
        **({"agents": job.agents} if case.hosts > 1 else {}),
        "cores": cores,
        **({"victim_units": units} if case.tp > 1 else {}),
        "outcome": verdict.outcome,
        **({"how": finished_how(out)} if verdict.outcome == "recovered" else {}),
        "ok": verdict.ok,
        "detail": verdict.detail,
        "note": verdict.note,
        "exit": job.code,
        "wall_s": round(job.wall_s, 2),
        "twin_s": round(twin_s, 2),
        "command": cmd,
        "rerun": f"scripts/chaos --seed {case.seed} --case {case.index}"
        + (f" --tp-weight {tp_weight:g}" if tp_weight else "")
        + (f" --snapshot-copies {case.snapshot_copies}" if case.snapshot_copies > 1 else "")
        + (f" --checkpoint-every {case.checkpoint_every}" if case.checkpoint_every else "")
        + (f" --max-restarts {case.max_restarts}" if case.max_restarts else "")
        + (" --schedule-weight 1" if case.schedule != "1f1b" else "")  # its coins, the same
        + (" --drawn-schedule auto" if case.schedule == "auto" else "")
        + (f" --applied-weight {case.applied_weight:g}" if case.applied_weight else "")
        + (" --core-kill-weight 1" if case.core_kill else "")  # its coin: the same side
        + (" --hosts-weight 1" if case.hosts > 1 else "")
        + f" --out {root.parent}",
        "run_dir": str(out),
    }
    if verdict.ok and not keep:
        shutil.rmtree(out, ignore_errors=True)
    return record


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def finished_how(out: Path) -> str:
    """How a recovered job finished: ``in-step`` (every change inside the step; ``in-step,
    rolled back`` when a failure tore a plan's apply and the plan was taken back),
    ``from a checkpoint`` (state was lost, and a change restored a disk checkpoint
    inside the job), or ``after a wait`` (a change waited for joining ranks, its state
    in memory)."""
    from elaswave.runtime.job.results import read_summary

    try:
        recoveries = read_summary(out).recoveries
    except ValueError:
        return "unknown"
    if any(r.restored for r in recoveries):
        return "from a checkpoint"
    if any(r.waited_s is not None for r in recoveries):
        return "after a wait"
    return "in-step, rolled back" if any(r.rolled_back for r in recoveries) else "in-step"


def table(records: list[dict]) -> str:
    outcomes = [
        o for o in (*OK_OUTCOMES, *FAIL_OUTCOMES) if any(r["outcome"] == o for r in records)
    ]
    outcomes = outcomes or list(OK_OUTCOMES)
    rows = []
    sizes = sorted({r.get("tp", 1) for r in records} - {1})
    tp_rows = [f"tp {t}" for t in sizes] if sizes else []
    for kind in (*KINDS, "waits for nodes", *tp_rows, "all cases"):
        sel = [
            r
            for r in records
            if kind == "all cases"
            or kind in _kinds(r["faults"])
            or (kind == "waits for nodes" and r.get("wait_for_nodes"))
            or (kind.startswith("tp ") and f"tp {r.get('tp', 1)}" == kind)
        ]
        counts = Counter(r["outcome"] for r in sel)
        rows.append([kind, str(len(sel)), *(str(counts.get(o, 0)) for o in outcomes)])
    head = ["fault kind", "cases", *outcomes]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    fmt = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(head), sep, *(fmt(r) for r in rows)])


def _kinds(faults: list[str]) -> set[str]:
    kinds = {f.split(":")[0].split("@")[0] for f in faults}
    if any(f.endswith((":plan", ":apply", ":applied")) for f in faults):
        kinds.add("in-recovery")
    return kinds


def _case_list(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/chaos",
        description="A randomized fault campaign over real processes (see the docstring "
        "of scripts/chaos.py for the draw, the checks and the outcome rules).",
    )
    parser.add_argument("--cases", type=int, default=300, help="cases to run (default 300)")
    parser.add_argument("--seed", type=int, default=1, help="campaign seed (default 1)")
    parser.add_argument("--case", help="run only these cases of the seed: K, K,L or K-L")
    parser.add_argument("--first", type=int, default=0, help="first case index (default 0)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/chaos"), help="run directories")
    parser.add_argument("--json", type=Path, help="write every case's record here")
    parser.add_argument("--md", type=Path, help="write the tally as a markdown report here")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per job")
    parser.add_argument("--keep", action="store_true", help="keep passing cases' run dirs")
    parser.add_argument("--dry-run", action="store_true", help="print the draw, run nothing")
    parser.add_argument(
        "--tp-weight",
        type=float,
        default=0.0,
        help="the chance that a case is tensor-parallel (tp 2 or 4; default 0: the draws "
        "of campaigns before --tp; a case that draws no tp is the same for every weight)",
    )
    parser.add_argument(
        "--snapshot-copies",
        dest="copies",
        type=int,
        default=1,
        help="copies of every snapshot in every case (default 1; the draws do not change)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="write a checkpoint every K steps in every case, TP ones included (default 0: "
        "none; lost state is then restored inside the job; the draws do not change)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="start a failed worker whose host is up again, up to K times a job, in every "
        "case (default 0: never; the draws do not change)",
    )
    parser.add_argument(
        "--schedule-weight",
        type=float,
        default=0.0,
        help="the chance that a case runs --schedule zb-h1 (then half its backward faults "
        "fire in the weight-gradient half; default 0; the other draws do not change)",
    )
    parser.add_argument(
        "--drawn-schedule",
        choices=("zb-h1", "auto"),
        default="zb-h1",
        help="the schedule a case drawn by --schedule-weight runs (default zb-h1; auto: "
        "the planner chooses, its backward faults stay in the backward)",
    )
    parser.add_argument(
        "--applied-weight",
        type=float,
        default=0.0,
        help="the chance that a fault drawn at the start of a plan's apply fires at its end "
        "instead (applied on the rank, not yet reported; default 0; the other draws do not "
        "change)",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="every case and its twin evaluate the held-out loss every K steps, which must "
        "match; half the optimizer faults at a step that evaluates fire in the evaluation "
        "(default 0; the other draws do not change)",
    )
    parser.add_argument(
        "--core-kill-weight",
        type=float,
        default=0.0,
        help="the chance that a case's Core SIGKILLs itself after its first recovery plan "
        "or commit, and a restarted Core restores from a restore point (default 0; the "
        "other draws do not change)",
    )
    parser.add_argument(
        "--hosts-weight",
        type=float,
        default=0.0,
        help="the chance that a case whose workers fill 2 to 4 nodes runs on that many "
        "hosts of this machine: node 0's job host and an agent each for the others "
        "(default 0; the other draws do not change)",
    )
    parser.add_argument(
        "--model-weight",
        type=float,
        default=0.0,
        help="the chance that a case trains a Hugging Face family instead of the built-in "
        f"model ({', '.join(sorted(MODELS))}: tiny, seeded; default 0; the other draws do "
        "not change)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        help="a job file every case and its twin train with (e.g. a recipe of clipping "
        "and a learning-rate schedule: examples/recipes/clip_cosine.toml); the draws do "
        "not change",
    )
    parser.add_argument(
        "--snapshot",
        action="store_true",
        help="copy elaswave/ once at the start and run every job (and the checks) on the "
        "copy: a campaign in a tree that others edit then tests one version",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.tp_weight <= 1:
        parser.error(f"--tp-weight {args.tp_weight:g}: must be from 0 to 1")
    if not 0 <= args.schedule_weight <= 1:
        parser.error(f"--schedule-weight {args.schedule_weight:g}: must be from 0 to 1")
    if args.copies < 1:
        parser.error(f"--snapshot-copies {args.copies}: must be at least 1")
    if args.checkpoint_every < 0:
        parser.error(f"--checkpoint-every {args.checkpoint_every}: must be 0 or more")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts {args.max_restarts}: must be 0 or more")
    if not 0 <= args.applied_weight <= 1:
        parser.error(f"--applied-weight {args.applied_weight:g}: must be from 0 to 1")
    if args.eval_every < 0:
        parser.error(f"--eval-every {args.eval_every}: must be 0 or more")
    if not 0 <= args.core_kill_weight <= 1:
        parser.error(f"--core-kill-weight {args.core_kill_weight:g}: must be from 0 to 1")
    if not 0 <= args.hosts_weight <= 1:
        parser.error(f"--hosts-weight {args.hosts_weight:g}: must be from 0 to 1")
    if not 0 <= args.model_weight <= 1:
        parser.error(f"--model-weight {args.model_weight:g}: must be from 0 to 1")
    indices = (
        _case_list(args.case) if args.case else list(range(args.first, args.first + args.cases))
    )
    root = (args.out / f"seed{args.seed}").resolve()
    global JOB_ENV, JOB_CWD, JOB_FILE
    if args.config is not None:
        if not args.config.is_file():
            parser.error(f"--config {str(args.config)!r}: no such file")
        JOB_FILE = ["--config", str(args.config.resolve())]
    if args.snapshot and not args.dry_run:
        root.mkdir(parents=True, exist_ok=True)
        code, digest = take_snapshot(root)
        sys.path.insert(0, str(code))
        JOB_ENV = {**os.environ, "PYTHONPATH": str(code)}
        JOB_CWD = root
        args.code = f"snapshot {digest} of the tree's elaswave/ in {code}"
        check = subprocess.run(
            [sys.executable, "-c", "import " + ", ".join(f"elaswave.{m}" for m in SMOKE)],
            capture_output=True,
            text=True,
            env=JOB_ENV,
            cwd=JOB_CWD,
            check=False,
        )
        if check.returncode != 0:
            tail = (check.stderr.strip().splitlines() or ["?"])[-1]
            print(f"chaos: the snapshot does not import ({tail}); try again later", flush=True)
            return 2
        print(f"chaos: running on a {args.code}", flush=True)
    else:
        # The checks (replay, compare) import the tree's elaswave/, as the jobs do: a
        # script's own directory, not the tree, is what Python puts on sys.path.
        sys.path.insert(0, str(ROOT))
        args.code = f"the tree {ROOT}"
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    args.code += f" (git HEAD {head or '?'} plus uncommitted edits, if any)"
    sources = write_models(root) if args.model_weight > 0 else {}
    records: list[dict] = []
    started = time.monotonic()
    for index in indices:
        case = draw_case(args.seed, index, args.tp_weight)
        case = replace(case, snapshot_copies=args.copies, checkpoint_every=args.checkpoint_every,
                       max_restarts=args.max_restarts)  # fmt: skip
        case = draw_schedule(case, args.schedule_weight, args.drawn_schedule)
        case = draw_eval(case, args.eval_every)
        case = draw_applied(case, args.applied_weight)
        case = draw_core_kill(case, args.core_kill_weight)
        case = draw_hosts(case, args.hosts_weight)
        case = draw_model(case, args.model_weight, sources)
        if args.dry_run:
            cmd = command(root / f"case{index:04d}", case.args(), case.env())
            print(f"case {index:>4}  {case.describe()}\n    {cmd}")
            continue
        rec = run_case(case, root, args.timeout, args.keep, args.tp_weight)
        records.append(rec)
        print(_case_line(case, rec), flush=True)
        if args.json:
            _write_json(args, records, time.monotonic() - started)
    if args.dry_run or not records:
        return 0
    total = time.monotonic() - started
    failed = [r for r in records if not r["ok"]]
    print()
    print(table(records))
    print(
        f"\n{len(records)} cases in {total:.0f} s: {total / len(records):.1f} s per case "
        f"(jobs {sum(r['wall_s'] for r in records) / len(records):.1f} s, twins "
        f"{sum(r['twin_s'] for r in records):.0f} s in all); {len(failed)} failed"
    )
    for rec in failed:
        print(f"  FAIL case {rec['case']} ({rec['outcome']}): {rec['rerun']}\n    {rec['command']}")
    if args.json:
        _write_json(args, records, total)
    if args.md:
        _write_md(args, records, total)
    return 1 if failed else 0


def _case_line(case: Case, rec: dict) -> str:
    took = f"{rec['wall_s']:.1f} s" + (f", twin {rec['twin_s']:.1f} s" if rec["twin_s"] else "")
    line = f"case {case.index:>4}  {case.describe()}  -> {rec['outcome']} ({took})"
    if not rec["ok"]:
        line += "  <-- FAIL"
    line += f"\n    {rec['command']}"
    if rec["outcome"] != "recovered":
        line += f"\n    {rec['detail']}"
    if rec["note"]:
        line += f"\n    note: {rec['note']}"
    return line


def _write_md(args: argparse.Namespace, records: list[dict], total: float) -> None:
    """The campaign as docs/chaos.md shows it: command, code, tally, timing, failures."""
    failed = [r for r in records if not r["ok"]]
    lines = [
        "# Randomized fault campaign (measured)",
        "",
        f"`scripts/chaos --cases {len(records)} --seed {args.seed}{_tp_flag(args)}` on "
        f"{args.code}: real "
        "processes, real SIGKILL/SIGSTOP, the real bus, on the 2-core host. Outcome rules: "
        "the docstring of `scripts/chaos.py` (`recovered`, `stopped-ok` "
        "and `stopped-waited` pass; any other outcome is a failure).",
        "",
        table(records),
        "",
        f"{len(records)} cases in {total:.0f} s ({total / len(records):.1f} s per case); "
        f"{len(failed)} failed. Recovered: {_hows(records)}.",
    ]
    if failed:
        lines += ["", "| case | outcome | reproduce |", "|---|---|---|"]
        lines += [f"| {r['case']} | {r['outcome']} | `{r['command']}` |" for r in failed]
    args.md.parent.mkdir(parents=True, exist_ok=True)
    args.md.write_text("\n".join(lines) + "\n")


def _hows(records: list[dict]) -> str:
    """How the recovered cases finished, counted."""
    hows = Counter(r["how"] for r in records if r["outcome"] == "recovered")
    return ", ".join(f"{n} {how}" for how, n in sorted(hows.items())) or "none"


def _tp_flag(args: argparse.Namespace) -> str:
    """The campaign's flags besides the seed (what reproduces its draws)."""
    copies = f" --snapshot-copies {args.copies}" if args.copies > 1 else ""
    every = f" --checkpoint-every {args.checkpoint_every}" if args.checkpoint_every else ""
    every += f" --max-restarts {args.max_restarts}" if args.max_restarts else ""
    zb = f" --schedule-weight {args.schedule_weight:g}" if args.schedule_weight else ""
    zb += " --drawn-schedule auto" if args.schedule_weight and args.drawn_schedule == "auto" else ""
    held = f" --eval-every {args.eval_every}" if args.eval_every else ""
    held += f" --applied-weight {args.applied_weight:g}" if args.applied_weight else ""
    tp = f" --tp-weight {args.tp_weight:g}" if args.tp_weight else ""
    core = f" --core-kill-weight {args.core_kill_weight:g}" if args.core_kill_weight else ""
    hosts = f" --hosts-weight {args.hosts_weight:g}" if args.hosts_weight else ""
    return tp + copies + every + zb + held + core + hosts


def _write_json(args: argparse.Namespace, records: list[dict], total: float) -> None:
    doc = {
        "seed": args.seed,
        **({"tp_weight": args.tp_weight} if args.tp_weight else {}),
        **({"snapshot_copies": args.copies} if args.copies > 1 else {}),
        **({"checkpoint_every": args.checkpoint_every} if args.checkpoint_every else {}),
        **({"max_restarts": args.max_restarts} if args.max_restarts else {}),
        **({"applied_weight": args.applied_weight} if args.applied_weight else {}),
        "code": args.code,
        "cases": len(records),
        "failed": sum(1 for r in records if not r["ok"]),
        "seconds": round(total, 1),
        "table": {
            kind: dict(
                Counter(
                    r["outcome"]
                    for r in records
                    if kind == "all cases" or kind in _kinds(r["faults"])
                )
            )
            for kind in (*KINDS, "all cases")
        },
        "records": records,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    sys.exit(main())
