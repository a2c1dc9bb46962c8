"""The ``elaswave`` command: train, run your script as the workers, replay, report,
simulate, tokenize text, evaluate and export a run.

User errors (flags, config files, layouts) print one line, ``elaswave: error: ...``, and
exit with status 2; a job that fails at run time exits with status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from elaswave import logs
from elaswave.cli import evaluate, export, sim, terminal, tokenize
from elaswave.cli.flags import PROFILE_AUTO, PROFILE_CHOICES, add_job_flags
from elaswave.rundir import CHECKPOINTS, EVENT_LOG, HEALTH_LOG, JOB, SUMMARY

if TYPE_CHECKING:
    from elaswave.runtime.host.profile import LayerProfile
    from elaswave.runtime.job.config import JobConfig


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train with dp x pp local workers",
        description="Start the Core and dp x pp local workers and train.",
    )
    add_job_flags(p)
    _add_log_format(p)


def _add_log_format(p: argparse.ArgumentParser) -> None:
    """``--log-format``: how this host shows structured logs (its own and the Core's)."""
    p.add_argument(
        "--log-format",
        choices=[f.value for f in logs.LogFormat],
        default=logs.LogFormat.AUTO.value,
        help="how structured logs (this host's, and the Core's, relayed) reach stderr: "
        "auto shows a person a readable line for the few that matter on a terminal and "
        "writes JSON lines otherwise; console: structlog's key-value lines; json: JSON "
        "lines (default auto). The Core's log is always in RUN_DIR/logs/coreN.log",
    )


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run your training script in every worker of an elastic job",
        description="Start the Core and dp x pp local workers, each running SCRIPT with "
        "ARGS (as torchrun does); inside, elaswave.job() gives the script its place and "
        "step loop, and a recovery happens inside job.train_step(). Job flags come before "
        "SCRIPT. The script's model (elaswave.job(model=...)) is read by running it once "
        "up to that call, unless --model is given.",
    )
    add_job_flags(p)
    _add_log_format(p)
    p.add_argument("script", type=Path, help="your training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


def _resume_sources(run_dir: Path, file_values: dict | None) -> list[dict | None]:
    """The resumed job's sources, in the order they apply: RUN_DIR's config, then the
    TOML file, then the checkpoint to start from: the latest complete one, written with
    the old job's tp, which the job keeps (flags come after them)."""
    from elaswave.fabric.checkpoint import latest_complete
    from elaswave.runtime.job.config import JobSpec

    if not (run_dir / JOB).is_file():
        raise ValueError(f"--resume {str(run_dir)!r}: not a run directory (no {JOB})")
    old = JobSpec.read(run_dir).config
    step = latest_complete(run_dir, old.model.num_layers, old.layout.tp)
    if step is None:
        raise ValueError(
            f"--resume {str(run_dir)!r}: no complete checkpoint under "
            f"{str(run_dir / CHECKPOINTS)!r}; train with --checkpoint-every K first"
        )
    values = old.to_dict()
    values.pop("profile", None)  # measured again, or not, as --profile says
    values["injection"].pop("faults")  # injected into the old run only
    resume = {
        "resume_dir": str(run_dir.resolve()),
        "resume_step": step,
        "resume_tp": old.layout.tp,
    }
    for key in resume:  # the checkpoint the old job started from, if it was resumed too
        values["state"].pop(key, None)
    return [values, file_values or {}, {"state": resume}]


def _refuse_unfinished(out: Path, *, resuming: Path | None) -> None:
    """Refuse to clear a run directory whose job stopped before the end (its Core was
    lost, or a failure stopped it) while a checkpoint could still continue it."""
    from elaswave.fabric.checkpoint import latest_complete
    from elaswave.runtime.job.config import JobSpec

    if resuming is not None and resuming.resolve() == out.resolve():
        return
    if not (out / JOB).is_file() or (out / SUMMARY).is_file():
        return
    try:
        old = JobSpec.read(out).config
        step = latest_complete(out, old.model.num_layers, old.layout.tp)
    except (OSError, KeyError, TypeError, ValueError):
        return  # not a readable run: nothing to continue
    if step is not None:
        raise ValueError(
            f"--out {str(out)!r} holds a job that stopped before its end, with a complete "
            f"checkpoint of step {step}: continue it with --resume {out}, or pass --overwrite "
            "to start over there"
        )


def _check_fits_in_memory(job) -> None:
    """Refuse a job whose parameters, gradients and optimizer state cannot fit in RAM."""
    import os

    from elaswave.fabric.remap import FP32_BYTES, STATE_TENSORS
    from elaswave.model.config import parameter_count

    params = parameter_count(job.model)
    # Every replica holds fp32 parameters and gradients; ZeRO-1 shards 12 B of state.
    need = params * (2 * FP32_BYTES * job.layout.dp + STATE_TENSORS * FP32_BYTES)
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have // 2:
        raise ValueError(
            f"model of {params / 1e9:.2f}B parameters needs about {need / 2**30:.0f} GiB "
            f"for dp={job.layout.dp}, more than half of this machine's {have / 2**30:.0f} GiB; "
            "the llama2-* presets are for the simulator, use --model tiny here"
        )


def _wants_profile(args: argparse.Namespace, job: JobConfig) -> bool:
    """Whether --profile asks for measured layer costs (auto: for a Hugging Face model
    without tensor parallelism: profiling measures whole layers)."""
    if args.profile not in PROFILE_CHOICES:
        valid = ", ".join(PROFILE_CHOICES)
        raise ValueError(f"--profile {args.profile!r}: valid values are {valid}")
    if args.profile == PROFILE_AUTO:
        return bool(job.model.source) and job.layout.tp == 1
    return args.profile == "on"


def _profile(job: JobConfig) -> tuple[JobConfig, LayerProfile]:
    """``job`` planned with its layers' measured costs, and the measurements, taken here
    on rank 0's device."""
    from elaswave.comm.backend import backend_for
    from elaswave.runtime.host.profile import profile_layers

    profile = profile_layers(job, device=backend_for(job.layout.device).device_for(0))
    print(f"elaswave: profiled {len(profile.layers)} layers in {profile.total_s:.2f} s")
    return dataclasses.replace(job, profile=profile.costs(job.cost_device)), profile


def _train(args: argparse.Namespace) -> int:
    import uvloop

    from elaswave.cli.config_file import build_job, load_toml
    from elaswave.cli.flags import job_values
    from elaswave.runtime.core.supervisor import JobFailed
    from elaswave.runtime.host.launcher import run_job
    from elaswave.runtime.host.zygote import Zygote

    if args.node_rank:  # a host other than node 0: its agent
        return _agent(args)
    if args.nnodes and args.nnodes > 1 and args.rdzv_endpoint and not args.bus_host:
        from elaswave.runtime.host.nodeagent import parse_endpoint

        args.bus_host = parse_endpoint(args.rdzv_endpoint)[0]  # where the others reach it
    file_values = load_toml(args.config) if args.config else None
    sources: list[dict | None] = [file_values]
    if args.resume is not None:
        sources = _resume_sources(args.resume, file_values)
    out = args.out or args.resume or Path("runs/train")
    if not args.overwrite:
        _refuse_unfinished(out, resuming=args.resume)
    script = {"schedule": {"script": getattr(args, "script_argv", None)}}  # elaswave run
    job = build_job(*sources, job_values(args), script)
    _check_fits_in_memory(job)
    if job.data.path is not None:  # fail now, not in every worker
        from elaswave.data.corpus import open_source

        open_source(job.data, vocab_size=job.model.vocab_size, seq_len=job.model.seq_len)
    if job.schedule.eval_every:
        from elaswave.data.corpus import open_heldout

        open_heldout(
            job.data, vocab_size=job.model.vocab_size, seq_len=job.model.seq_len,
            windows=job.schedule.eval_batches * job.schedule.global_batch,
        )  # fmt: skip
    profiling = _wants_profile(args, job)
    lay, sch = job.layout, job.schedule
    print(
        f"elaswave: training dp={lay.dp} x pp={lay.pp}{f' x tp={lay.tp}' if lay.tp > 1 else ''} "
        f"({lay.num_ranks} workers, device {lay.device}) "
        f"for {sch.steps} steps, global batch {sch.global_batch}; run dir {out}"
    )
    # Before any thread or event loop: it forks every Core and worker, with what this
    # process has loaded for the job (torch, the model's library) already loaded.
    zygote = Zygote.start()
    try:
        profile = None
        if profiling:  # after the zygote's fork: it stays clear of torch's threads
            job, profile = _profile(job)
        progress = terminal.Progress(sch.steps, emulated=lay.device == "emulated", run_dir=out)
        summary = uvloop.run(run_job(job, out, on_event=progress, zygote=zygote, profile=profile))
    except JobFailed as exc:
        print(f"elaswave: job failed: {exc}", file=sys.stderr)
        return 1
    finally:
        zygote.close()
    print(
        f"elaswave: done: {summary.steps_completed} steps, final loss "
        f"{summary.loss[-1]:.4f}, {summary.samples_per_s:.1f} samples/s "
        f"({summary.timing}), "
        f"{summary.events} events; summary: {out / SUMMARY}"
    )
    return 0


def _agent(args: argparse.Namespace) -> int:
    """``--node-rank R`` (R > 0): this host's agent; the job comes from node 0."""
    import uvloop

    from elaswave.runtime.host.nodeagent import RendezvousFailed, parse_endpoint, run_agent
    from elaswave.runtime.host.zygote import Zygote

    if args.node_rank < 0 or (args.nnodes is not None and args.node_rank >= args.nnodes > 0):
        limit = f"[0, {args.nnodes})" if args.nnodes else "non-negative"
        raise ValueError(f"--node-rank {args.node_rank}: must be {limit}")
    if not args.rdzv_endpoint:
        raise ValueError(f"--node-rank {args.node_rank} needs --rdzv-endpoint HOST:PORT of node 0")
    parse_endpoint(args.rdzv_endpoint)
    slots = args.ranks_per_node  # None: the job's
    out = args.out or Path("runs/train")
    offer = "the job's --nproc-per-node" if slots is None else slots
    print(f"elaswave: node {args.node_rank} agent ({offer} workers) joining {args.rdzv_endpoint}")
    zygote = Zygote.start()  # before any thread or event loop: it forks this host's workers
    try:
        code = uvloop.run(
            run_agent(
                out,
                node=args.node_rank,
                slots=slots,
                endpoint=args.rdzv_endpoint,
                keys_dir=args.bus_keys,
                zygote=zygote,
            )
        )
    except RendezvousFailed as exc:
        print(f"elaswave: node {args.node_rank} agent: {exc}", file=sys.stderr)
        return 1
    finally:
        zygote.close()
    print(f"elaswave: node {args.node_rank} agent: the run {'finished' if code == 0 else 'failed'}")
    return code


def _run(args: argparse.Namespace) -> int:
    from elaswave.cli.script import describe

    script = args.script.resolve()
    if not script.is_file():
        raise ValueError(f"script {str(args.script)!r} does not exist")
    if args.node_rank:  # an agent: the job, script included, comes from node 0
        return _agent(args)
    if args.model is None:
        args.model = describe(script, args.script_args)
    args.script_argv = (str(script), *args.script_args)
    return _train(args)


def _events(args: argparse.Namespace) -> int:
    from elaswave.bus.eventlog import format_record
    from elaswave.bus.rolling import removed
    from elaswave.bus.schema import Beacon
    from elaswave.runtime.core.runlog import RecordFilter, parse_kinds, parse_ranks, read_run_log

    path = args.run_dir / EVENT_LOG
    if not path.is_file():
        raise ValueError(
            f"no event log at {str(path)!r}; is {str(args.run_dir)!r} a run directory?"
        )
    wanted = RecordFilter(
        kinds=None if args.kind is None else parse_kinds(args.kind),
        ranks=None if args.rank is None else parse_ranks(args.rank),
    )
    hidden = 0
    for record in filter(wanted, read_run_log(args.run_dir, health=not args.no_health)):
        if not args.all and isinstance(record.event, Beacon):
            hidden += 1  # delivery bookkeeping: each process's last numbers, 4 per second
            continue
        print(format_record(record))
    if hidden:
        print(f"elaswave: {hidden} beacon(s) not shown (--all shows them)", file=sys.stderr)
    if not args.no_health and (gone := removed(args.run_dir / HEALTH_LOG)):
        print(
            f"elaswave: the health log's {gone} oldest segment(s) were removed to keep it "
            "within --health-log-mib: step timings and heartbeats before its first shown "
            "are gone (the event log is whole)",
            file=sys.stderr,
        )
    return 0


def _keys(args: argparse.Namespace) -> int:
    """Write a fresh CURVE key set for a job's bus."""
    from elaswave.bus.keys import generate_keys

    keys = generate_keys(args.dir)
    print(
        f"elaswave: wrote the bus's server and client keys to {keys.directory} (secrets mode "
        f"0600); train with --bus-keys {keys.directory} to bind beyond 127.0.0.1"
    )
    return 0


def _replay(args: argparse.Namespace) -> int:
    """Recompute every recovery plan of a run from its event log; 1 if one diverges."""
    from elaswave.runtime.core.replay import replay_run

    result = replay_run(args.run_dir)
    for bad in result.unreadable:
        print(f"skipped unreadable record: {bad}")
    for forged in result.ignored:
        print(f"skipped a plan not from the Core: {forged}")
    for p in result.plans:
        what = f"generation {p.generation}" + (f" (attempt {p.attempt})" if p.attempt else "")
        what += f", {p.kind}"
        what += f" of ranks {list(p.failed)}" if p.failed else ""
        what += f", joining {list(p.joined)}" if p.joined else ""
        if p.ok:
            print(f"{what}: plan {p.digest} reproduced")
            continue
        print(f"{what}: DIVERGES")
        for problem in p.problems:
            print(f"  {problem}")
        print(f"  announced by: {p.event}")
        print(f"  caused by:    {p.cause or '(no detector, pause or scale event before it)'}")
    diverged = result.diverged
    if diverged is not None:
        good = len(result.plans) - 1
        print(
            f"elaswave: replay: the plan of generation {diverged.generation} diverges ({good} "
            "reproduced before it); later plans build on it and were not replayed",
            file=sys.stderr,
        )
        return 1
    if not result.plans:
        print("elaswave: replay: the log holds no recovery plan: nothing to replay")
    else:
        print(
            f"elaswave: replay: {len(result.plans)} plan(s) reproduced byte for byte "
            "(plan digests), with their committed steps and reasons"
        )
    return 0


def _scale(args: argparse.Namespace) -> int:
    """Ask a running job's Core for more workers, and wait until they have joined."""
    import queue

    from elaswave.api import connect
    from elaswave.bus.schema import (
        EventKind,
        RecoveryFinished,
        RunFinished,
        ScaleRequest,
    )

    if args.add < 1:
        raise ValueError(f"--add {args.add}: must be at least 1 worker")
    if (args.run_dir / SUMMARY).is_file():
        raise ValueError(f"the job in {str(args.run_dir)!r} has already finished")
    done: queue.Queue[object] = queue.Queue()
    with connect(args.run_dir, sender="elaswave-scale") as session:
        session.subscribe(done.put, kinds=[EventKind.RECOVERY_FINISHED, EventKind.RUN_FINISHED])
        session.publish(ScaleRequest(sender="elaswave-scale", add=args.add, reason=args.reason))
        print(f"elaswave: asked for {args.add} more worker(s); waiting for them to join")
        joined: list[int] = []
        while len(joined) < args.add:
            try:
                event = done.get(timeout=args.timeout)
            except queue.Empty:
                raise ValueError(
                    f"no worker joined within {args.timeout:g} s; see "
                    f"`elaswave events {args.run_dir}`"
                ) from None
            if isinstance(event, RunFinished):
                raise ValueError("the job finished before the workers could join")
            if isinstance(event, RecoveryFinished) and event.joined:
                joined += event.joined
                print(f"elaswave: ranks {event.joined} joined at step {event.step}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from elaswave.cli.report import write_report

    return write_report(args.run_dir, args.out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elaswave", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_run(sub)
    ev = sub.add_parser("events", help="print a run's event log readably")
    ev.add_argument("run_dir", type=Path)
    ev.add_argument(
        "--all",
        action="store_true",
        help="include the bus's delivery beacons (logs written before they were left out)",
    )
    ev.add_argument(
        "--no-health",
        action="store_true",
        help=f"leave out RUN_DIR/{HEALTH_LOG} (step timings and heartbeats, its newest kept)",
    )
    ev.add_argument(
        "--kind",
        metavar="KIND[,KIND...]",
        help="only events of these kinds (as printed: failure_detected, recovery_plan, ...)",
    )
    ev.add_argument(
        "--rank",
        metavar="RANK[,RANK...]",
        help="only events about these ranks: sent by one, or naming it (rank, ranks, failed, "
        "joined, slow_ranks)",
    )
    ky = sub.add_parser(
        "keys",
        help="make CURVE keys for a job's bus (needed to bind beyond 127.0.0.1)",
        description="Write a server and a client key pair (ZeroMQ certificate files) into "
        "DIR. A job trained with --bus-keys DIR encrypts its bus and admits only processes "
        "that hold them; copy DIR to every host of the job.",
    )
    ky.add_argument("dir", type=Path)
    rl = sub.add_parser(
        "replay",
        help="recompute a run's recovery plans from its event log and check them",
        description="Feed RUN_DIR's recorded events through the planners, starting from the "
        "job's initial plan, and check that every recovery plan the Core announced comes out "
        "byte for byte the same (digest, committed step, reason). Exit 1 at the first "
        "divergence, printed with the event that caused it.",
    )
    rl.add_argument("run_dir", type=Path)
    sc = sub.add_parser("scale", help="add workers to a running job")
    sc.add_argument("run_dir", type=Path)
    sc.add_argument("--add", type=int, default=1, help="workers to add (default 1)")
    sc.add_argument("--reason", default="elaswave scale", help="recorded with the request")
    sc.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for them to join")
    rp = sub.add_parser(
        "report",
        help="plot a finished run's throughput and plan changes to a PNG",
        description="Write a PNG of RUN_DIR's samples/s per step, with every plan change "
        "(fail-stop, fail-slow, join) marked, and the layers of every stage before and "
        "after each change; print one line per change. Needs the plot extra (matplotlib).",
    )
    rp.add_argument("run_dir", type=Path)
    rp.add_argument("--out", type=Path, help="PNG to write (default RUN_DIR/report.png)")
    sim.add_parser(sub)
    tokenize.add_parser(sub)
    evaluate.add_parser(sub)
    export.add_parser(sub)
    args = parser.parse_args(argv)
    if (log_format := getattr(args, "log_format", None)) is not None:  # train, run
        logs.configure_for(logs.LogFormat(log_format), terminal.people, terminal.to_stderr)
    else:
        logs.configure()
    commands = {
        "train": _train,
        "run": _run,
        "events": _events,
        "replay": _replay,
        "keys": _keys,
        "scale": _scale,
        "report": _report,
        "sim": sim.run,
        "tokenize": tokenize.run,
        "evaluate": evaluate.run,
        "export": export.run,
    }
    try:
        return commands[args.command](args)
    except ValueError as exc:
        print(f"elaswave: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("elaswave: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `elaswave events RUN | head`: the reader has what it wanted
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def console() -> int:
    """The ``elaswave`` command: :func:`main`, in a process that then exits. What the
    process holds is frozen first, so that the interpreter's last collection skips it
    (torch and a job's records: 0.6 s of every ``elaswave train``)."""
    try:
        return main()
    finally:
        gc.freeze()


if __name__ == "__main__":
    sys.exit(console())
