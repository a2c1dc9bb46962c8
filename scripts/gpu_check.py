"""Everything a GPU machine can check of ElasWave, in one command.

    scripts/gpu_check [--quick] [--cases NAME|GLOB ...] [--steps N] [--out DIR] [--dry-run]
                      [--device cuda|cpu-strict|cpu] [--budget SECONDS]

Cases (``--dry-run`` lists them):

- ``layout-{tiny,llama,megatron}-{dp2,pp2,dp2xpp2,tp2,dp2xpp2-zb}``: the built-in
  model, a Hugging Face Llama (config.json only, written here: no download) and a
  megatron-core GPT (its JSON shape file, written here; TP through megatron's own
  layers) trained on ``--device cuda`` and on ``--device cpu``; losses within 1e-5,
  final parameters within 1e-4 (relative, fp32). ``-zb`` runs ``--schedule zb-h1``.
- ``{kill,hang}-{phase}``: SIGKILL (``kill``) or SIGSTOP (``hang``) of rank 1 of
  dp2 x pp2 in each phase of step 3 that fault injection supports (``weight``, the
  weight-gradient half of a split backward, under ``--schedule zb-h1``); the job must
  finish every step without restarting a process (one worker start per rank, one Core),
  match its fault-free run within 1e-4, and every survivor must abandon its step within
  1 s of the failure's announcement (release, from events.log). Figures: MTTR, release.
- ``churn``: a 20-change trace on dp4 x pp2 (kills and hangs in every phase, a slow
  rank, joins: :data:`CHURN`); the two ranks that live through all of it must hold no
  more threads at the end than the worker that joined last (the job grows from 8 to 16
  ranks, and threads grow with communicators and peers) and gain no GPU memory between
  the first change and the last step (sampled from /proc and nvidia-smi); MTTR median,
  and the survivors' resident host memory against the last joiner's (a figure).
- ``hosts-tp``: dp2 x tp2 on two hosts of this machine (an agent on loopback), a TP
  group each, a member on node 1 killed: the one-host run's numbers, each group's leader
  on its host's device 0 (``LOCAL_RANK``), the ranks sharing the GPUs.
- ``restart``: dp2 x pp2 with ``--max-restarts 1``, rank 1 killed mid-backward: a new
  worker starts on the device rank 1 freed (its ``LOCAL_RANK``), joins, and the job
  matches its fault-free run; one Core.
- ``snapshot-overhead``: dp2 x pp2 with and without host snapshots (throughput, the
  snapshot threads' CPU share; parameters must be identical).

With fewer GPUs than a run's ranks, the ranks share them in NCCL's test-only mode
(``ELASWAVE_SHARE_DEVICE=1``: see elaswave/comm/backend.py). ``--device cpu`` runs the
same cases on CPU, as a self-test of this script. Prints one line per case, a summary,
writes OUT/gpu_check.json (run directories in OUT/runs) and exits 1 if any case failed
or was not run. The bash wrapper scripts/gpu_check installs .whl/ when it exists.
"""

from __future__ import annotations

import argparse
import enum
import fnmatch
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from gpu_probe import Run, events_of, growth, release, run_train

from elaswave.bus.schema import WorkerStarted
from elaswave.runtime.core.compare import compare_runs
from elaswave.runtime.job.faults import RECOVERY_POINTS, StepPhase
from elaswave.runtime.job.results import Summary, read_summary

ROOT = Path(__file__).resolve().parents[1]
LAYOUT_TOLERANCE = 1e-5
"""Device against CPU: losses, relative, fp32."""
PARAM_TOLERANCE = 1e-4
"""Device against CPU: final parameters, relative, fp32. Looser than the losses':
AdamW divides each update by the root of its second moment, so the last-bit
differences of CUDA's and the CPU's kernels grow in the parameters (1.4e-5 seen for the
Llama on dp2 after 8 steps, losses 5e-8 apart)."""
FAULT_TOLERANCE = 1e-4
"""A recovered run against its fault-free run (scripts/fault_matrix.py's)."""
RELEASE_LIMIT_S = 1.0
THREAD_SLACK = 8
"""Threads a survivor may hold at the end of the churn trace beyond the worker that
joined last (which holds the final plan's groups; a survivor also holds the waiter
threads its busiest step needed and its snapshot links), or, where none joined, beyond
its own count before the first change. One communicator leaked per change would be
about 60 over the trace's 20 changes."""
GPU_SLACK_MIB = 512
"""GPU memory a survivor may gain over the churn trace (it may take more samples)."""
FAULT_RANK, FAULT_STEP = 1, 3
JOB = ("--global-batch", "8", "--micro-batch", "2", "--profile", "off")
LAYOUTS = {
    "dp2": (2, 1, 1), "pp2": (1, 2, 1), "dp2xpp2": (2, 2, 1), "tp2": (1, 1, 2),
    "dp2xpp2-zb": (2, 2, 1),
}  # fmt: skip
SCHEDULE_OF = {"dp2xpp2-zb": "zb-h1"}
"""Layouts run under another pipeline schedule than 1F1B (the backward split in halves)."""
MODELS = ("tiny", "llama", "megatron")
LLAMA: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    tie_word_embeddings=False,
)  # fmt: skip
"""tests/fault/test_model_adapters.py's tiny Llama: a config.json, seeded weights."""
MEGATRON: dict[str, int] = dict(
    num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
    ffn_hidden_size=160, vocab_size=128,
)  # fmt: skip
"""tests/fault/test_model_adapters.py's megatron-core GPT: a JSON shape file."""
ELSEWHERE = (*RECOVERY_POINTS, StepPhase.WEIGHT, StepPhase.EVAL)
"""Points that fire only in a recovery, a split backward or a held-out evaluation."""
PHASES = tuple(p for p in StepPhase if p not in ELSEWHERE)
CHURN = (
    "kill:1@2:forward", "join@3", "hang:5@5:backward", "join@6", "kill:2@8:grad-sync", "join@9",
    "kill:6@11:snapshot", "join@12", "slow:3=2@13", "join@14", "kill:3@15:optimizer", "join@16",
    "join@17", "hang:7@18:forward", "join@19", "join@21", "join@23", "join@25", "join@27",
    "join@29", "join@31",
)  # fmt: skip
"""A churn trace of 20 changes on dp4 x pp2 (6 failures in every phase, SIGKILL and
SIGSTOP, a slow rank that then dies, 14 joins) that, unlike scripts/churn_runtime.py's
(which loses every original rank), leaves ranks 0 and 4 to live through all of them, so
that their threads and GPU memory can be compared before and after."""
CHURN_STEPS = 34
QUICK = (
    "layout-tiny-dp2xpp2",
    "layout-tiny-tp2",
    "layout-llama-dp2xpp2",
    "kill-backward",
    "hang-backward",
    "snapshot-overhead",
)

Figure = float | int | str | None


class Status(enum.StrEnum):
    PASS = "PASS"
    FAIL = "FAIL"
    NOT_RUN = "NOT RUN"


@dataclass(frozen=True, kw_only=True)
class Outcome:
    name: str
    status: Status
    figures: dict[str, Figure] = field(default_factory=dict)
    detail: str = ""
    """Why it failed (empty on a pass)."""


DEVICES = ("cuda", "cpu-strict", "cpu")


@dataclass(frozen=True, kw_only=True)
class Options:
    device: str
    """cuda (the check), cpu-strict (the same cases under NCCL's rules on CPU) or cpu (a
    self-test of this script)."""
    out: Path
    steps: int
    cases: tuple[str, ...]
    """Names or globs of the cases to run (empty: all)."""
    dry_run: bool
    run_timeout_s: float
    """One ``elaswave train`` run's deadline (churn: three times it)."""
    budget_s: float
    """The whole check's: cases not started within it are NOT RUN."""
    jobs: int = 1
    """Cases run at once (the snapshot-overhead case, a timing, always runs alone, last)."""

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"--device {self.device!r}: expected one of {', '.join(DEVICES)}")
        if self.steps < FAULT_STEP + 2:
            raise ValueError(
                f"--steps {self.steps}: at least {FAULT_STEP + 2} (faults strike step {FAULT_STEP})"
            )
        if self.run_timeout_s <= 0 or self.budget_s <= 0:
            raise ValueError("--run-timeout and --budget must be positive seconds")
        if self.jobs < 1:
            raise ValueError(f"--jobs {self.jobs}: at least 1")


class Checker:
    """Runs ``elaswave train`` for the cases, each run once however many cases use it."""

    def __init__(self, opts: Options, gpus: int) -> None:
        self.opts, self.gpus = opts, gpus
        self.deadline = time.monotonic() + opts.budget_s
        self._lock = threading.Lock()
        self._runs: dict[str, Future[Run]] = {}
        self._models: dict[str, str] = {}

    def env(self, device: str, processes: int, *, share: bool = False) -> dict[str, str]:
        """``share``: the ranks share the GPUs whatever their number (hosts on this
        machine: each host's local rank 0 is GPU 0)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        paths = [str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        if device == "cuda" and (share or self.gpus < processes):
            env["ELASWAVE_SHARE_DEVICE"] = "1"
        return env

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    def train(
        self,
        key: str,
        args: Sequence[str],
        *,
        device: str,
        processes: int,
        scale: float = 1.0,
        watch: bool = False,
        share: bool = False,
    ) -> Run:
        """The run ``key`` (``elaswave train --device DEVICE ARGS``), started by its
        first caller; later callers get the same run (``share``: :meth:`env`'s)."""
        with self._lock:
            future, mine = self._runs.get(key), False
            if future is None:
                future, mine = self._runs.setdefault(key, Future()), True
        if not mine:
            return future.result()
        out = self.opts.out / "runs" / key
        argv = [sys.executable, "-m", "elaswave.cli.main", "train", "--out", str(out),
                "--overwrite", "--device", device, *args]  # fmt: skip
        timeout = max(1.0, min(self.opts.run_timeout_s * scale, self.remaining_s()))
        env = self.env(device, processes, share=share)
        run = run_train(argv, out, env=env, timeout_s=timeout, watch=watch, gpu=device == "cuda")
        future.set_result(run)
        return run

    def model(self, name: str) -> str:
        """The ``--model`` value of ``name``: a preset, or a model file written here (an
        HF directory, a megatron shape file)."""
        if name == "tiny":
            return name
        with self._lock:
            if name not in self._models:
                directory = self.opts.out / "models" / name
                directory.mkdir(parents=True, exist_ok=True)
                if name == "megatron":
                    (directory / "gpt.json").write_text(json.dumps(MEGATRON))
                    self._models[name] = f"megatron:{directory / 'gpt.json'}"
                else:
                    import transformers  # only for the Hugging Face cases

                    transformers.LlamaConfig(**LLAMA).save_pretrained(directory)
                    self._models[name] = f"hf:{directory}"
            return self._models[name]


def _layout_args(layout: str, steps: int) -> tuple[list[str], int]:
    dp, pp, tp = LAYOUTS[layout]
    flags: dict[str, object] = {"--dp": dp, "--pp": pp, "--tp": tp, "--steps": steps}
    if layout in SCHEDULE_OF:
        flags["--schedule"] = SCHEDULE_OF[layout]
    return [*JOB, *(x for flag, value in flags.items() for x in (flag, str(value)))], dp * pp * tp


def _summary(run: Run) -> tuple[Summary | None, str]:
    """The run's summary, or None and why not."""
    if not run.ok:
        return None, run.reason
    try:
        return read_summary(run.out), ""
    except ValueError as exc:
        return None, str(exc)


def reference(ck: Checker, model: str, layout: str, device: str, *, twin: bool = False) -> Run:
    """``model`` on ``layout``, fault-free, on ``device``; ``twin``: the CPU run a device
    run is compared with (a run of its own also under ``--device cpu``)."""
    args, processes = _layout_args(layout, ck.opts.steps)
    key = f"{model}-{layout}-{device}" + ("-twin" if twin and device == ck.opts.device else "")
    return ck.train(key, ["--model", ck.model(model), *args], device=device, processes=processes)


def check_layout(ck: Checker, model: str, layout: str) -> Outcome:
    name = f"layout-{model}-{layout}"
    with ThreadPoolExecutor(2) as pool:  # the device run and its CPU twin side by side
        on_device = pool.submit(reference, ck, model, layout, ck.opts.device)
        on_cpu = pool.submit(reference, ck, model, layout, "cpu", twin=True)
        dev, cpu = on_device.result(), on_cpu.result()
    figures: dict[str, Figure] = {"device_s": round(dev.wall_s, 1), "cpu_s": round(cpu.wall_s, 1)}
    (ds, why_dev), (cs, why_cpu) = _summary(dev), _summary(cpu)
    if ds is None or cs is None:
        detail = f"device run: {why_dev or 'ok'}; cpu run: {why_cpu or 'ok'}"
        return Outcome(name=name, status=Status.FAIL, figures=figures, detail=detail)
    diff = compare_runs(dev.out, cpu.out)
    gaps = [abs(a - b) for a, b in zip(ds.loss, cs.loss, strict=False)]
    figures |= {
        "loss_rel": diff.loss_rel,
        "param_rel": diff.param_rel,
        "loss_abs": max(gaps, default=0.0),
        "steps": ds.steps_completed,
    }
    problems = [
        f"the {where} run recovered from {len(s.recoveries)} failure(s); it has no fault"
        for where, s in (("device", ds), ("cpu", cs))
        if s.recoveries  # elastic recovery keeps the losses: it would hide a crash
    ]
    if ds.steps_completed != cs.steps_completed:
        problems.append(f"{ds.steps_completed} steps on the device, {cs.steps_completed} on cpu")
    if diff.loss_rel > LAYOUT_TOLERANCE:
        problems.append(f"losses differ by {diff.loss_rel:.1e}")
    if diff.param_rel > PARAM_TOLERANCE:
        problems.append(f"parameters differ by {diff.param_rel:.1e}")
    return _outcome(name, figures, problems)


def _outcome(name: str, figures: dict[str, Figure], problems: Sequence[str]) -> Outcome:
    status = Status.FAIL if problems else Status.PASS
    return Outcome(name=name, status=status, figures=figures, detail="; ".join(problems))


def check_fault(ck: Checker, kind: str, phase: StepPhase) -> Outcome:
    name = f"{kind}-{phase}"
    layout = "dp2xpp2-zb" if phase is StepPhase.WEIGHT else "dp2xpp2"  # W: a split backward
    args, processes = _layout_args(layout, ck.opts.steps)
    fault = ["--fault", f"{kind}:{FAULT_RANK}@{FAULT_STEP}:{phase}"]
    if kind == "hang":
        fault += ["--heartbeat-timeout", "2"]  # a SIGSTOPped rank is found by its silence
    run = ck.train(name, [*args, *fault], device=ck.opts.device, processes=processes)
    ref = reference(ck, "tiny", layout, ck.opts.device)
    (summary, why), (ref_summary, why_ref) = _summary(run), _summary(ref)
    figures: dict[str, Figure] = {"wall_s": round(run.wall_s, 1)}
    if summary is None or ref_summary is None:
        return Outcome(
            name=name,
            status=Status.FAIL,
            figures=figures,
            detail=why or f"fault-free run: {why_ref}",
        )
    events = events_of(run.out)
    starts = sum(1 for e in events if isinstance(e, WorkerStarted))
    released = release(run.out, events)
    diff = compare_runs(run.out, ref.out)
    recovered = [r for r in summary.recoveries if FAULT_RANK in r.ranks]
    figures |= {
        "steps": summary.steps_completed,
        "recoveries": len(summary.recoveries),
        "mttr_s": recovered[0].mttr_s if recovered else None,
        "detect_s": recovered[0].phases.detect if recovered else None,
        "release_s": None if released is None else released.from_announcement_s,
        "release_from_fault_s": None if released is None else released.from_fault_s,
        "loss_rel": diff.loss_rel,
        "param_rel": diff.param_rel,
        "worker_starts": starts,
    }
    problems = _fault_problems(summary, ref_summary, bool(recovered), starts, processes, figures)
    return _outcome(name, figures, problems)


def _fault_problems(
    summary: Summary,
    ref: Summary,
    recovered: bool,
    starts: int,
    processes: int,
    figures: dict[str, Figure],
) -> list[str]:
    problems = []
    if summary.steps_completed != ref.steps_completed:
        problems.append(f"{summary.steps_completed} of {ref.steps_completed} steps")
    if not recovered:
        problems.append(f"no recovery of rank {FAULT_RANK} recorded")
    if starts != processes or (summary.core_incarnations or 1) != 1:
        problems.append(
            f"processes restarted: {starts} worker starts for {processes} ranks, "
            f"{summary.core_incarnations} Core incarnations"
        )
    for key in ("loss_rel", "param_rel"):
        value = figures[key]
        if isinstance(value, float) and value > FAULT_TOLERANCE:
            problems.append(f"{key} {value:.1e} against the fault-free run")
    released = figures["release_s"]
    if not isinstance(released, float):
        problems.append("no release measured (a survivor never reported RecoveryReady)")
    elif released > RELEASE_LIMIT_S:
        problems.append(f"release took {released:.2f} s (limit {RELEASE_LIMIT_S} s)")
    return problems


def check_churn(ck: Checker) -> Outcome:
    joins = sum(1 for f in CHURN if f.startswith("join"))
    faults = [a for f in CHURN for a in ("--fault", f)]
    args = [*JOB, "--dp", "4", "--pp", "2", "--steps", str(CHURN_STEPS), "--heartbeat-timeout", "2"]
    run = ck.train("churn", [*args, *faults], device=ck.opts.device, processes=8 + joins,
                   scale=3.0, watch=True)  # fmt: skip
    summary, why = _summary(run)
    figures: dict[str, Figure] = {"wall_s": round(run.wall_s, 1)}
    if summary is None:
        return Outcome(name="churn", status=Status.FAIL, figures=figures, detail=why)
    mttrs = sorted(r.mttr_s for r in summary.recoveries)
    grown = growth(run.samples, events_of(run.out))
    figures |= {
        "steps": summary.steps_completed,
        "recoveries": len(summary.recoveries),
        "mttr_median_s": mttrs[len(mttrs) // 2] if mttrs else None,
        # the most process groups a participant held, as the workers report them: at the
        # first change and at the last (bounded by the groups a rank belongs to)
        "communicators_first": summary.recoveries[0].communicators if mttrs else None,
        "communicators_last": summary.recoveries[-1].communicators if mttrs else None,
    }
    if grown is not None:
        figures |= asdict(grown)
    problems = []
    if summary.steps_completed != CHURN_STEPS:
        problems.append(f"{summary.steps_completed} of {CHURN_STEPS} steps")
    if grown is None:
        problems.append("no samples before the first change and after the last")
    else:
        base = grown.joiner_threads_after or grown.threads_before
        if grown.threads_after > base + THREAD_SLACK:
            problems.append(
                f"survivor threads {grown.threads_before} -> {grown.threads_after} "
                f"(the last joiner's: {grown.joiner_threads_after})"
            )
        before, after = grown.gpu_mib_before, grown.gpu_mib_after
        if before is not None and after is not None and after > before + GPU_SLACK_MIB:
            problems.append(f"survivor GPU memory {before} -> {after} MiB")
    return _outcome("churn", figures, problems)


def check_snapshots(ck: Checker) -> Outcome:
    from snapshot_overhead import snapshot_share, throughput  # scripts/snapshot_overhead.py

    args, processes = _layout_args("dp2xpp2", ck.opts.steps)
    # Its own pair, run one after the other: the layout cases run a device run and its
    # CPU twin side by side, which would slow one side of the comparison.
    bare = ck.train(
        "tiny-dp2xpp2-no-snapshots",
        [*args, "--no-snapshots"],
        device=ck.opts.device,
        processes=processes,
    )
    kept = ck.train("tiny-dp2xpp2-snapshots", args, device=ck.opts.device, processes=processes)
    (with_, why), (without, why_bare) = _summary(kept), _summary(bare)
    if with_ is None or without is None:
        detail = f"with snapshots: {why or 'ok'}; without: {why_bare or 'ok'}"
        return Outcome(name="snapshot-overhead", status=Status.FAIL, detail=detail)
    fast, slow = throughput(without), throughput(with_)
    figures: dict[str, Figure] = {
        "samples_per_s_with": slow,
        "samples_per_s_without": fast,
        "overhead": 1 - slow / fast,
        "snapshot_cpu_share": snapshot_share(kept.out),
    }
    same = with_.param_digest == without.param_digest
    return _outcome(
        "snapshot-overhead", figures, [] if same else ["snapshots changed the parameters"]
    )


EXACT_SUMS = ROOT / "examples" / "recipes" / "exact_sums.toml"


def check_exact_sums(ck: Checker) -> Outcome:
    """dp2 x pp2 with float64 gradient sums, rank FAULT_RANK killed mid-backward, against
    dp1 x pp1 fault-free, both on the device: on a CPU device the same bits; on an
    accelerator within FAULT_TOLERANCE, its figures reported (the same bits where its
    kernels are deterministic)."""
    config = ["--config", str(EXACT_SUMS)]
    args, processes = _layout_args("dp2xpp2", ck.opts.steps)
    fault = ["--fault", f"kill:{FAULT_RANK}@{FAULT_STEP}:backward"]
    run = ck.train("exact-sums-kill", [*args, *config, *fault], device=ck.opts.device,
                   processes=processes)  # fmt: skip
    one = [*JOB, "--dp", "1", "--pp", "1", "--steps", str(ck.opts.steps), *config]
    ref = ck.train("exact-sums-one", one, device=ck.opts.device, processes=1)
    (summary, why), (ref_summary, why_ref) = _summary(run), _summary(ref)
    if summary is None or ref_summary is None:
        detail = f"killed run: {why or 'ok'}; one process: {why_ref or 'ok'}"
        return Outcome(name="exact-sums", status=Status.FAIL, detail=detail)
    diff = compare_runs(run.out, ref.out)
    exact = diff.loss_rel == 0.0 and diff.param_rel == 0.0
    figures: dict[str, Figure] = {
        "loss_rel": diff.loss_rel, "param_rel": diff.param_rel, "bitwise": str(exact),
        "steps": summary.steps_completed,
    }  # fmt: skip
    problems = []
    if not any(FAULT_RANK in r.ranks for r in summary.recoveries):
        problems.append(f"no recovery of rank {FAULT_RANK}")
    if ck.opts.device.startswith("cpu") and not exact:
        problems.append(f"not the bits of one process: {diff}")
    if max(diff.loss_rel, diff.param_rel) > FAULT_TOLERANCE:
        problems.append(f"{diff} from one process")
    return _outcome("exact-sums", figures, problems)


def check_hosts(ck: Checker) -> Outcome:
    """dp2 x tp2 on two hosts of this machine (node 0's job host, and node 1's agent on
    loopback), a TP group each; node 1's member 1 (process 3) killed mid-backward at
    step FAULT_STEP. The job must finish every step, match the one-host fault-free run
    within FAULT_TOLERANCE, and each host must give its group's leader its device 0
    (``LOCAL_RANK``), whatever the group's process ranks."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    hosts = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    args = [*JOB, "--dp", "2", "--pp", "1", "--tp", "2", "--steps", str(ck.opts.steps)]
    node1 = ck.opts.out / "runs" / "hosts-tp-node1"
    node1.mkdir(parents=True, exist_ok=True)
    with (node1.parent / "hosts-tp-node1.log").open("w") as sink:
        agent = subprocess.Popen(
            [sys.executable, "-m", "elaswave.cli.main", "train", "--out", str(node1), *hosts,
             "--node-rank", "1"],
            stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
            env=ck.env(ck.opts.device, 4, share=True),
        )  # fmt: skip
    fault = ["--fault", f"kill:3@{FAULT_STEP}:backward"]
    try:
        run = ck.train("hosts-tp", [*args, *fault, *hosts, "--node-rank", "0"],
                       device=ck.opts.device, processes=4, share=True)  # fmt: skip
        agent_code = agent.wait(60)
    except subprocess.TimeoutExpired:
        agent_code = None
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    ref = ck.train("hosts-tp-ref", args, device=ck.opts.device, processes=4)
    (summary, why), (ref_summary, why_ref) = _summary(run), _summary(ref)
    figures: dict[str, Figure] = {"wall_s": round(run.wall_s, 1), "agent_exit": agent_code}
    if summary is None or ref_summary is None:
        detail = f"two hosts: {why or 'ok'}; one host: {why_ref or 'ok'}"
        return Outcome(name="hosts-tp", status=Status.FAIL, figures=figures, detail=detail)
    diff = compare_runs(run.out, ref.out)
    local = {e.rank: e.local_rank for e in events_of(run.out) if isinstance(e, WorkerStarted)}
    recovered = [r for r in summary.recoveries if 1 in r.ranks]
    figures |= {
        "steps": summary.steps_completed, "loss_rel": diff.loss_rel, "param_rel": diff.param_rel,
        "mttr_s": recovered[0].mttr_s if recovered else None, "local_ranks": str(local),
    }  # fmt: skip
    problems = []
    if summary.steps_completed != ref_summary.steps_completed:
        problems.append(f"{summary.steps_completed} of {ref_summary.steps_completed} steps")
    if not recovered:
        problems.append("no recovery of rank 1 (node 1's group)")
    if local != {0: 0, 1: 0}:
        problems.append(f"the groups' leaders' local ranks {local}, not 0 on each host")
    if agent_code != 0:
        problems.append(f"node 1's agent exited {agent_code}")
    if max(diff.loss_rel, diff.param_rel) > FAULT_TOLERANCE:
        problems.append(f"{diff} from the one-host run")
    return _outcome("hosts-tp", figures, problems)


def check_restart(ck: Checker) -> Outcome:
    """dp2 x pp2 with one restart, rank FAULT_RANK killed mid-backward at FAULT_STEP: the
    worker started in its place must take the device it freed (its local rank), join,
    and the job match its fault-free run within FAULT_TOLERANCE, on one Core."""
    args, processes = _layout_args("dp2xpp2", ck.opts.steps)
    fault = ["--fault", f"kill:{FAULT_RANK}@{FAULT_STEP}:backward", "--max-restarts", "1"]
    run = ck.train("restart", [*args, *fault], device=ck.opts.device, processes=processes)
    ref = reference(ck, "tiny", "dp2xpp2", ck.opts.device)
    (summary, why), (ref_summary, why_ref) = _summary(run), _summary(ref)
    figures: dict[str, Figure] = {"wall_s": round(run.wall_s, 1)}
    if summary is None or ref_summary is None:
        detail = why or f"fault-free run: {why_ref}"
        return Outcome(name="restart", status=Status.FAIL, figures=figures, detail=detail)
    local = {e.rank: e.local_rank for e in events_of(run.out) if isinstance(e, WorkerStarted)}
    diff = compare_runs(run.out, ref.out)
    kinds = [(str(r.kind), r.ranks) for r in summary.recoveries]
    figures |= {
        "steps": summary.steps_completed, "loss_rel": diff.loss_rel, "param_rel": diff.param_rel,
        "recoveries": str(kinds), "local_ranks": str(local),
    }  # fmt: skip
    problems = []
    if summary.steps_completed != ref_summary.steps_completed:
        problems.append(f"{summary.steps_completed} of {ref_summary.steps_completed} steps")
    if kinds[:2] != [("fail-stop", (FAULT_RANK,)), ("join", (processes,))]:
        problems.append(f"not a loss of rank {FAULT_RANK} and the join of its restart: {kinds}")
    if local.get(processes) != local.get(FAULT_RANK):
        problems.append(f"the restart took local rank {local.get(processes)}, not the freed one")
    if (summary.core_incarnations or 1) != 1:
        problems.append(f"{summary.core_incarnations} Core incarnations")
    if max(diff.loss_rel, diff.param_rel) > FAULT_TOLERANCE:
        problems.append(f"{diff} from the fault-free run")
    return _outcome("restart", figures, problems)


@dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    what: str
    check: Callable[[Checker], Outcome]


def all_cases() -> list[Case]:
    cases = [
        Case(
            name=f"layout-{model}-{layout}",
            what=f"{model} on {layout}: device against cpu",
            check=partial(check_layout, model=model, layout=layout),
        )
        for model in MODELS
        for layout in LAYOUTS
    ]
    cases += [
        Case(
            name=f"{kind}-{phase}",
            what=f"{signal} rank {FAULT_RANK} of dp2xpp2 at step {FAULT_STEP}, {phase}",
            check=partial(check_fault, kind=kind, phase=phase),
        )
        for kind, signal in (("kill", "SIGKILL"), ("hang", "SIGSTOP"))
        for phase in (*PHASES, StepPhase.WEIGHT)
    ]
    cases.append(
        Case(
            name="churn",
            what="20 changes on dp4xpp2; survivors' threads, GPU memory",
            check=check_churn,
        )
    )
    cases.append(
        Case(
            name="exact-sums",
            what="dp2xpp2, float64 gradient sums, a kill: the bits of one process",
            check=check_exact_sums,
        )
    )
    cases.append(
        Case(
            name="hosts-tp",
            what="dp2xtp2 on two loopback hosts, a member on node 1 killed",
            check=check_hosts,
        )
    )
    cases.append(
        Case(
            name="restart",
            what="dp2xpp2, rank 1 killed and started again on its device",
            check=check_restart,
        )
    )
    cases.append(
        Case(
            name="snapshot-overhead",
            what="dp2xpp2 with and without snapshots",
            check=check_snapshots,
        )
    )
    return cases


def select(cases: Sequence[Case], patterns: Sequence[str]) -> list[Case]:
    """The cases ``patterns`` name (all when empty), in the order of the first pattern that
    names each (``--cases churn '*'`` runs churn first); ValueError for a pattern naming none."""
    if not patterns:
        return list(cases)
    names = [c.name for c in cases]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            raise ValueError(f"--cases {pattern!r} names no case; valid: {', '.join(names)}")
    ordered = [c for p in patterns for c in cases if fnmatch.fnmatchcase(c.name, p)]
    first: dict[str, Case] = {}
    for case in ordered:
        first.setdefault(case.name, case)
    return list(first.values())


def run_case(ck: Checker, case: Case) -> Outcome:
    """``case``'s outcome; a case that raises fails with the error, never a traceback."""
    if ck.remaining_s() < 10:
        return Outcome(
            name=case.name,
            status=Status.NOT_RUN,
            detail=f"the budget of {ck.opts.budget_s:.0f} s was spent",
        )
    try:
        return case.check(ck)
    except Exception as exc:  # a case's failure is a FAIL line, not a traceback
        return Outcome(name=case.name, status=Status.FAIL, detail=f"{type(exc).__name__}: {exc}")


def _format(outcome: Outcome) -> str:
    def show(value: Figure) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.1e}"
        return str(value)

    figures = " ".join(f"{k}={show(v)}" for k, v in outcome.figures.items())
    line = f"{outcome.status:7} {outcome.name:24} {figures}"
    return line + (f"\n        {outcome.detail[:600]}" if outcome.detail else "")


def machine(device: str) -> dict[str, Figure]:
    """What ran the check: commit, Python, torch, the GPUs (count and name)."""
    import torch

    commit = os.environ.get("ELASWAVE_COMMIT") or _git_commit()
    doc: dict[str, Figure] = {
        "commit": commit,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": device,
        "gpus": 0,
    }
    if device == "cuda" and torch.cuda.is_available():
        doc |= {"gpus": torch.cuda.device_count(), "gpu": torch.cuda.get_device_name(0)}
    return doc


def _git_commit() -> str:
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git; set ELASWAVE_COMMIT)"
    return head.stdout.strip()


def parse(argv: Sequence[str]) -> Options:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device",
        default="cuda",
        help="cuda (default); cpu-strict: the cases under NCCL's rules on CPU; cpu: a self-test",
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        default=[],
        metavar="NAME",
        help="names or globs, e.g. 'layout-*' kill-backward (default: all)",
    )
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}; 6 steps")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 8)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="for OUT/gpu_check.json and OUT/runs/ (default: a temp dir)",
    )
    parser.add_argument("--run-timeout", type=float, default=120.0, help="seconds per run")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for the whole check")
    parser.add_argument(
        "--jobs", type=int, default=1, help="cases at once (churn and timing cases still run alone)"
    )
    parser.add_argument("--dry-run", action="store_true", help="list the cases, run nothing")
    args = parser.parse_args(argv)
    out = args.out if args.out is not None else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    steps = args.steps if args.steps is not None else (6 if args.quick else 8)
    cases = tuple(args.cases) if args.cases or not args.quick else QUICK
    return Options(
        device=args.device,
        out=out,
        steps=steps,
        cases=cases,
        dry_run=args.dry_run,
        run_timeout_s=args.run_timeout,
        budget_s=args.budget,
        jobs=args.jobs,
    )


def report(opts: Options, header: dict[str, Figure], outcomes: Sequence[Outcome]) -> int:
    counts = {s: sum(1 for o in outcomes if o.status is s) for s in Status}
    where = f"{header.get('gpus')} x {header.get('gpu', opts.device)}, torch {header['torch']}"
    print(
        f"gpu_check: {counts[Status.PASS]} passed, {counts[Status.FAIL]} failed, "
        f"{counts[Status.NOT_RUN]} not run, on {where}, commit {header['commit']}"
    )
    doc = {**header, "steps": opts.steps, "cases": [asdict(o) for o in outcomes]}
    opts.out.mkdir(parents=True, exist_ok=True)
    path = opts.out / "gpu_check.json"
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"gpu_check: figures in {path}")
    return 0 if counts[Status.PASS] == len(outcomes) else 1


def main(argv: Sequence[str]) -> int:
    try:
        opts = parse(argv)
        cases = select(all_cases(), opts.cases)
    except ValueError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    if opts.dry_run:
        for case in cases:
            print(f"{'PLAN':7} {case.name:24} {case.what}")
        print(f"gpu_check: {len(cases)} cases planned, {opts.steps} steps a run (dry run)")
        return 0
    header = machine(opts.device)
    if opts.device == "cuda" and not header["gpus"]:
        print(
            f"FAIL    cuda: torch {header['torch']} (CUDA {header['cuda']}) sees no CUDA device; "
            "scripts/gpu_check --device cpu self-tests this script"
        )
        return 1
    print(f"gpu_check: {len(cases)} cases, {opts.jobs} at a time, on {header}", flush=True)
    ck = Checker(opts, int(header["gpus"] or 0))
    return report(opts, header, run_cases(ck, cases))


ALONE = ("churn", "snapshot-overhead")
"""Cases run one at a time, after the others: a timing, and churn, whose 16 processes
(with a 2 s heartbeat timeout) were fenced at start while other cases shared the
host's cores (an H100 with 16)."""


def run_cases(ck: Checker, cases: Sequence[Case]) -> list[Outcome]:
    """Every case's outcome, in ``cases``' order; up to ``jobs`` at once, each line
    printed as its case ends."""

    def one(case: Case) -> Outcome:
        outcome = run_case(ck, case)
        print(_format(outcome), flush=True)
        return outcome

    shared = [c for c in cases if c.name not in ALONE]
    with ThreadPoolExecutor(ck.opts.jobs) as pool:
        done = dict(zip((c.name for c in shared), pool.map(one, shared), strict=True))
    done |= {c.name: one(c) for c in cases if c.name in ALONE}
    return [done[c.name] for c in cases]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
