"""The flags of a job, shared by ``elaswave train`` and ``elaswave run``: layout, model,
data, timeouts, faults, policies, hosts. Each maps onto a field of the config classes
(:mod:`elaswave.cli.config_file`), where its values are checked."""

from __future__ import annotations

import argparse
from pathlib import Path

from elaswave.comm.spec import DEVICES

PROFILE_AUTO = "auto"
PROFILE_CHOICES = (PROFILE_AUTO, "on", "off")


def add_job_flags(p: argparse.ArgumentParser) -> None:
    """The job flags ``elaswave train`` and ``elaswave run`` share."""
    p.add_argument("--config", type=Path, help="TOML file with [model], [data], [optim], [train]")
    p.add_argument("--dp", type=int, help="data-parallel replicas per stage")
    p.add_argument("--pp", type=int, help="pipeline stages")
    p.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel members of every (stage, replica), one failure unit "
        "(the built-in model; ranks ordered tp fastest, then dp, then pp)",
    )
    p.add_argument("--world-size", type=int, help="processes to start (must equal dp x pp x tp)")
    p.add_argument("--steps", type=int, help="optimizer steps")
    p.add_argument("--global-batch", type=int, help="samples per step")
    p.add_argument("--micro-batch", type=int, help="samples per micro-batch per replica")
    p.add_argument("--seed", type=int, help="seed of initialisation and dropout")
    p.add_argument("--device", help=f"one of {', '.join(DEVICES)}")
    p.add_argument(
        "--model",
        help="model preset (tiny; llama2-* are for the simulator) or hf:DIR, a Hugging Face "
        "Llama, Mistral or Qwen2 directory (config.json, optional *.safetensors)",
    )
    p.add_argument("--data", help="pre-tokenised token file (numpy memmap); default synthetic")
    p.add_argument("--data-dtype", help="token dtype of --data: uint16, int32 or int64")
    p.add_argument("--comm-timeout", type=float, help="seconds any collective may wait")
    p.add_argument(
        "--heartbeat-timeout", type=float, help="seconds of silence before a worker is fenced"
    )
    p.add_argument(
        "--plan-ack-timeout",
        type=float,
        help="seconds every participant has to acknowledge a recovery plan (default 5)",
    )
    p.add_argument(
        "--core-restarts",
        type=int,
        help="times a lost Core is started again while the workers train on (default 3)",
    )
    p.add_argument(
        "--core-restart-delay",
        type=float,
        help="seconds to wait before starting a lost Core again (default 0)",
    )
    p.add_argument(
        "--wait-for-nodes",
        type=float,
        metavar="SECONDS",
        help="when too few ranks are left to fill every pipeline stage, wait this long for "
        "joining ranks with the state in memory before stopping (default 0: stop at once)",
    )
    p.add_argument(
        "--core-outage",
        type=float,
        help="seconds workers train without hearing the Core before they all pause at one "
        "step boundary and wait for it (default 10)",
    )
    p.add_argument("--ranks-per-node", type=int, help="consecutive ranks per node (default 1)")
    p.add_argument(
        "--nproc-per-node",
        type=int,
        dest="ranks_per_node",
        help="workers per host of a multi-host job (torchrun's name for --ranks-per-node)",
    )
    p.add_argument("--nnodes", type=int, help="hosts of the job, one agent each (default 1)")
    p.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this host's node rank: 0 runs the Core and the store, others run an agent",
    )
    p.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="node 0's address and the port its store serves the other hosts on",
    )
    p.add_argument(
        "--no-snapshots",
        action="store_false",
        dest="snapshots",
        default=None,
        help="keep no host snapshots of optimizer shards (a lost shard is then unrecoverable)",
    )
    p.add_argument(
        "--verify-snapshots",
        action="store_true",
        default=None,
        help="record per-step digests of every optimizer shard and its snapshot",
    )
    p.add_argument(
        "--fault",
        action="append",
        dest="faults",
        metavar="SPEC",
        help="inject a fault, repeatable: kill:RANK@STEP[:PHASE], "
        "kill-node:NODE@STEP[:PHASE], hang:RANK@STEP[:PHASE], slow:RANK=FACTOR@STEP "
        "(compute FACTOR x slower) or join@STEP (a worker joins); PHASE: forward, "
        "backward, grad-sync, snapshot, optimizer",
    )
    p.add_argument(
        "--precision",
        help="fp32 (default) or bf16: bfloat16 compute with fp32 parameters, gradient "
        "reduction, optimizer state and snapshots",
    )
    p.add_argument("--rng", help="dropout randomness: counter (default) or stateful")
    p.add_argument(
        "--rebalance",
        help="answer to a failure or straggler: none, resize (default), migrate "
        "(+ layer migration) or migrate+dvfs (+ frequency scaling)",
    )
    p.add_argument(
        "--migration",
        help="how migrating layers' parameters move: nonblocking (default: streamed while "
        "the source computes a shadow for the early micro-batches) or blocking",
    )
    p.add_argument(
        "--partition",
        help="initial layers per stage: even (default) or balanced (minimax under the cost model)",
    )
    p.add_argument(
        "--profile",
        default=PROFILE_AUTO,
        metavar="{auto,on,off}",
        help="measure every layer's forward, backward and activations before the job starts "
        "and plan with those costs instead of the FLOP formulas (written to "
        "RUN_DIR/profile.json); auto (default): on for a Hugging Face model, off for the "
        "built-in one",
    )
    p.add_argument("--checkpoint-every", type=int, help="write a checkpoint every K steps")
    p.add_argument(
        "--bus-host", help="IP address the bus binds on (default 127.0.0.1; others need keys)"
    )
    p.add_argument("--bus-keys", help="directory of the job's CURVE keys (elaswave keys DIR)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in --out even if it holds an unfinished job with checkpoints",
    )
    p.add_argument(
        "--worker-prefix",
        metavar="WORDS",
        help="run each worker under these words, {rank} replaced by its rank (e.g. "
        "'ip netns exec host{rank}')",
    )
    p.add_argument(
        "--bus-faults",
        metavar="SPEC",
        help="inject faults into every process's received bus messages, to test delivery: "
        "drop=P,dup=P,reorder=P,delay=SECONDS,seed=N",
    )
    p.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue RUN_DIR's job from its latest complete checkpoint, on the "
        "layout the flags give (default: the same)",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="run directory (default runs/train; with --resume, the resumed run directory)",
    )
