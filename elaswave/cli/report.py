"""``elaswave report RUN_DIR``: a finished run's throughput and plan changes, as a PNG.

The figure has two panels: samples/s per step (global batch / step time, from
summary.json) with a vertical line where each plan change took effect and a dotted one
at each straggler verdict from the event log; and one bar row per plan (the initial
plan, then the plan after each change) showing every stage's layers [lo, hi), its DP
width and its clock. Runs on ``--device emulated`` are labelled EMULATED in the title,
the axis, the PNG's metadata and the printed lines.

Everything but :func:`render` is pure and needs no matplotlib, which is imported only
there (the ``plot`` extra).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elaswave.bus.schema import Event, RecoveryKind, StragglerDetected
from elaswave.rundir import EVENT_LOG, JOB, REPORT, SUMMARY

PLOT_EXTRA = "install the plot extra: pip install 'elaswave[plot]'"


@dataclass(frozen=True)
class StageRow:
    """One stage of a plan as the report draws it."""

    layers: tuple[int, int]
    """[lo, hi) layer range."""
    ranks: tuple[int, ...]
    sizes: tuple[int, ...]
    mhz: float | None = None

    @property
    def dp(self) -> int:
        return len(self.ranks)

    @property
    def layer_text(self) -> str:
        return f"[{self.layers[0]},{self.layers[1]})"


@dataclass(frozen=True)
class PlanRow:
    """A plan (the initial one or one a change installed) and the label of its row."""

    label: str
    stages: tuple[StageRow, ...]
    schedule: str | None = None
    """The pipeline schedule it runs (None: a summary written before schedules were
    recorded)."""

    @property
    def layer_text(self) -> str:
        return " ".join(s.layer_text for s in self.stages)

    @property
    def schedule_text(self) -> str:
        return self.schedule or "?"

    @property
    def dp_text(self) -> str:
        return " ".join(str(s.dp) for s in self.stages)

    @property
    def mhz_text(self) -> str:
        return " ".join("base" if s.mhz is None else f"{s.mhz:g}" for s in self.stages)

    @property
    def has_clocks(self) -> bool:
        return any(s.mhz is not None for s in self.stages)


@dataclass(frozen=True)
class Change:
    """One recovery record of summary.json: a plan change at ``step`` (the first step
    trained on the new plan)."""

    step: int
    kind: str
    ranks: tuple[int, ...]
    before: PlanRow
    after: PlanRow
    bytes_moved: int | None = None
    mttr_s: float | None = None

    @property
    def what(self) -> str:
        """What changed, in a few words: resize, migrate, dvfs, shrink, grow."""
        return " + ".join(change_words(self.before.stages, self.after.stages)) or "no change"

    @property
    def label(self) -> str:
        """e.g. ``fail-stop r5 → resize + migrate``."""
        return f"{self.kind} {rank_text(self.ranks)} → {self.what}"

    def line(self) -> str:
        """The stdout line: step, kind, ranks, layers before → after."""
        text = (
            f"step {self.step}: {self.kind} ranks {list(self.ranks)}: layers "
            f"{self.before.layer_text} → {self.after.layer_text}; dp {self.before.dp_text} → "
            f"{self.after.dp_text}"
        )
        if self.before.has_clocks or self.after.has_clocks:
            text += f"; MHz {self.before.mhz_text} → {self.after.mhz_text}"
        if self.before.schedule != self.after.schedule:
            text += f"; schedule {self.before.schedule_text} → {self.after.schedule_text}"
        elif self.after.schedule is not None:
            text += f"; schedule {self.after.schedule}"
        extra = [self.what]
        if self.bytes_moved is not None:
            extra.append(f"{self.bytes_moved} bytes moved")
        if self.mttr_s is not None:
            extra.append(f"MTTR {self.mttr_s:.2f} s")
        return f"{text} ({'; '.join(extra)})"


@dataclass(frozen=True)
class Verdict:
    """A StragglerDetected event: ranks slow by factors, or back to normal."""

    step: int
    ranks: tuple[int, ...]
    factors: tuple[float, ...]
    recovered: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        parts = [f"r{r} ×{f:.2g}" for r, f in zip(self.ranks, self.factors, strict=False)]
        if self.recovered:
            parts.append(f"{rank_text(self.recovered)} normal again")
        return "straggler " + (", ".join(parts) or "verdict cleared")


@dataclass(frozen=True)
class TimelineRow:
    """One rank's actions in one step, as it measured them: (operation, micro-batch,
    start, end), seconds from its step's start."""

    rank: int
    stage: int
    step: int
    actions: tuple[tuple[str, int, float, float], ...]


def timeline(results: Iterable[Any]) -> tuple[TimelineRow, ...]:
    """The last step every rank traced with times, from the workers' results
    (:class:`~elaswave.runtime.job.results.WorkerResult`), by stage then rank; none when
    no rank traced times."""
    rows = []
    for r in results:
        timed = [t for t in r.traces if t.times and len(t.times) == len(t.actions)]
        if timed:
            t = timed[-1]
            pairs = zip(t.actions, t.times, strict=True)
            acts = tuple((op, mb, a, b) for (op, mb), (a, b) in pairs)
            rows.append(TimelineRow(r.rank, r.stage, t.step, acts))
    return tuple(sorted(rows, key=lambda row: (row.stage, row.rank)))


@dataclass(frozen=True)
class Report:
    """Everything the figure and the printed lines show."""

    run_name: str
    device: str
    timing: str
    """"emulated" or "measured", as summary.json says."""
    global_batch: int
    steps: tuple[int, ...]
    samples_per_s: tuple[float, ...]
    plans: tuple[PlanRow, ...]
    """The initial plan, then the plan after each change."""
    changes: tuple[Change, ...]
    verdicts: tuple[Verdict, ...] = ()
    timeline: tuple[TimelineRow, ...] = ()
    """Each rank's actions in a traced step of the initial plan (empty: none traced)."""

    @property
    def emulated(self) -> bool:
        return self.timing == "emulated"

    @property
    def timing_text(self) -> str:
        return "EMULATED timings" if self.emulated else f"{self.timing} timings"

    @property
    def mean_samples_per_s(self) -> float:
        """Samples over total time, as summary.json's ``samples_per_s``."""
        times = [self.global_batch / r for r in self.samples_per_s if r > 0 and math.isfinite(r)]
        return self.global_batch * len(times) / sum(times) if times else math.nan

    @property
    def title(self) -> str:
        first = self.plans[0]
        layout = f"dp {max(s.dp for s in first.stages)} × pp {len(first.stages)}"
        return (
            f"ElasWave run {self.run_name}: {layout}, device {self.device}, "
            f"{len(self.changes)} plan change(s) — {self.timing_text}"
        )

    def lines(self) -> list[str]:
        """What the command prints: a header, the initial plan, one line per change."""
        n = len(self.steps)
        span = f"steps {self.steps[0]}-{self.steps[-1]}" if n else "no steps"
        out = [
            f"elaswave: report of {self.run_name}: {n} steps ({span}), "
            f"{self.mean_samples_per_s:.1f} samples/s, {self.timing_text}, "
            f"{len(self.changes)} plan change(s)",
            f"initial plan: layers {self.plans[0].layer_text}; dp {self.plans[0].dp_text}"
            + (f"; schedule {self.plans[0].schedule}" if self.plans[0].schedule else ""),
        ]
        return out + [c.line() for c in self.changes]


# --------------------------------------------------------------------------- pure helpers


def rank_text(ranks: Sequence[int]) -> str:
    return "r" + ",".join(str(r) for r in ranks) if ranks else "no rank"


def change_words(before: Sequence[StageRow], after: Sequence[StageRow]) -> list[str]:
    """What a plan change did, in the planner's terms."""
    words = []
    old = {r for s in before for r in s.ranks}
    new = {r for s in after for r in s.ranks}
    if old - new:
        words.append("shrink")
    if new - old:
        words.append("grow")
    if [(s.ranks, s.sizes) for s in before] != [(s.ranks, s.sizes) for s in after]:
        words.append("resize")
    if [s.layers for s in before] != [s.layers for s in after]:
        words.append("migrate")
    if [s.mhz for s in before] != [s.mhz for s in after]:
        words.append("dvfs")
    return words


def throughput(
    step_time_s: Sequence[float], global_batch: int, first_step: int = 0
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """(steps, samples/s per step); a step with no positive time has rate nan."""
    steps = tuple(range(first_step, first_step + len(step_time_s)))
    rates = tuple(global_batch / t if t > 0 else math.nan for t in step_time_s)
    return steps, rates


def straggler_verdicts(events: Iterable[Event]) -> tuple[Verdict, ...]:
    return tuple(
        Verdict(e.step, tuple(e.ranks), tuple(e.factors), tuple(e.recovered))
        for e in events
        if isinstance(e, StragglerDetected)
    )


class _Doc:
    """Typed access to a JSON document; errors name the file and the field."""

    def __init__(self, source: str) -> None:
        self.source = source

    def get(self, doc: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
        if not isinstance(doc, dict):
            raise ValueError(f"{self.source}: {where or 'the document'} is not a JSON object")
        if key not in doc:
            raise ValueError(f"{self.source}: {_path(where, key)} is missing")
        value = doc[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) or not isinstance(value, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise ValueError(
                f"{self.source}: {_path(where, key)} should be {names}, "
                f"not {type(value).__name__} {json.dumps(value)[:40]}"
            )
        return value

    def ints(self, doc: Any, key: str, where: str, length: int | None = None) -> tuple[int, ...]:
        values = self.get(doc, key, list, where)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values) or (
            length is not None and len(values) != length
        ):
            count = f"{length} " if length is not None else ""
            raise ValueError(
                f"{self.source}: {_path(where, key)} should be a list of {count}integers, "
                f"not {json.dumps(values)[:40]}"
            )
        return tuple(values)

    def schedule(self, plan: Any, where: str) -> str | None:
        """A plan's ``schedule`` (None where the document predates it)."""
        if not isinstance(plan, dict) or "schedule" not in plan:
            return None
        from elaswave.engine.plan import parse_schedule

        value = self.get(plan, "schedule", str, where)
        try:
            return parse_schedule(value).value
        except ValueError as exc:  # "schedule 'x' (known: ...)"
            raise ValueError(f"{self.source}: {where}.{exc}") from None

    def stages(self, plan: Any, where: str) -> tuple[StageRow, ...]:
        """The stages of a plan as :func:`elaswave.engine.plan.plan_summary` writes."""
        raw = self.get(plan, "stages", list, where)
        if not raw:
            raise ValueError(f"{self.source}: {where}.stages is empty")
        rows = []
        for i, stage in enumerate(raw):
            at = f"{where}.stages[{i}]"
            lo, hi = self.ints(stage, "layers", at, length=2)
            if not 0 <= lo < hi:
                raise ValueError(f"{self.source}: {at}.layers [{lo}, {hi}] is not a layer range")
            mhz = stage.get("mhz") if isinstance(stage, dict) else None
            if mhz is not None:
                mhz = float(self.get(stage, "mhz", (int, float), at))
            rows.append(
                StageRow(
                    (lo, hi), self.ints(stage, "ranks", at), self.ints(stage, "sizes", at), mhz
                )
            )
        return tuple(rows)


def _path(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def build_report(
    summary: Any,
    initial_plan: Any,
    *,
    run_name: str,
    events: Iterable[Event] = (),
    source: str = SUMMARY,
) -> Report:
    """The report of a run from its summary.json document, its initial plan (as
    ``plan_summary`` writes a plan) and its event log's events; ValueError names the
    file and the field of anything malformed."""
    doc = _Doc(source)
    global_batch = doc.get(summary, "global_batch", int, "")
    if global_batch < 1:
        raise ValueError(f"{source}: global_batch = {global_batch}: must be positive")
    times = doc.get(summary, "step_time_s", list, "")
    if not all(isinstance(t, int | float) and not isinstance(t, bool) for t in times):
        raise ValueError(f"{source}: step_time_s should be a list of numbers")
    first_step = doc.get(summary, "first_step", int, "") if "first_step" in summary else 0
    if first_step < 0:
        raise ValueError(f"{source}: first_step = {first_step}: must be >= 0")
    device = doc.get(summary, "device", str, "")
    timing = summary.get("timing", "emulated" if device == "emulated" else "measured")
    if not isinstance(timing, str):
        raise ValueError(f"{source}: timing should be str, not {type(timing).__name__}")

    job = _Doc(JOB)
    schedule = job.schedule(initial_plan, "plan")
    plans = [PlanRow("initial", job.stages(initial_plan, "plan"), schedule)]
    changes = []
    for i, rec in enumerate(doc.get(summary, "recoveries", list, "")):
        at = f"recoveries[{i}]"
        step = doc.get(rec, "step", int, at)
        kind = doc.get(rec, "kind", str, at)
        ranks = doc.ints(rec, "ranks", at)
        plan = doc.get(rec, "plan", dict, at)
        after = PlanRow(
            f"step {step}: {kind} {rank_text(ranks)}",
            doc.stages(plan, f"{at}.plan"),
            doc.schedule(plan, f"{at}.plan"),
        )
        moved, mttr = rec.get("bytes_moved"), rec.get("mttr_s")
        changes.append(
            Change(
                step,
                kind,
                ranks,
                plans[-1],
                after,
                moved if isinstance(moved, int) else None,
                float(mttr) if isinstance(mttr, int | float) else None,
            )
        )
        plans.append(after)
    steps, rates = throughput(times, global_batch, first_step)
    return Report(
        run_name=run_name,
        device=device,
        timing=timing,
        global_batch=global_batch,
        steps=steps,
        samples_per_s=rates,
        plans=tuple(plans),
        changes=tuple(changes),
        verdicts=straggler_verdicts(events),
    )


# --------------------------------------------------------------------------- reading a run


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{str(path)!r} is corrupt: not UTF-8 text") from None
    except OSError as exc:
        raise ValueError(f"cannot read {str(path)!r}: {exc.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        what = "empty" if not text.strip() else f"{exc.msg} at line {exc.lineno} col {exc.colno}"
        raise ValueError(f"{str(path)!r} is corrupt: not valid JSON ({what})") from None


def _initial_plan(run_dir: Path) -> dict[str, Any]:
    """The run's first plan, rebuilt from job.json's config as the launcher built it."""
    from elaswave.engine.plan import plan_summary
    from elaswave.runtime.job.config import JobConfig

    path = run_dir / JOB
    if not path.is_file():
        raise ValueError(f"no {JOB} in {str(run_dir)!r}: cannot tell the run's initial plan")
    doc = _read_json(path)
    config = doc.get("config") if isinstance(doc, dict) else None
    if not isinstance(config, dict):
        raise ValueError(f"{str(path)!r} is corrupt: it has no 'config' object")
    try:
        return plan_summary(JobConfig.from_dict(config).plan())
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{str(path)!r} is corrupt: its config is invalid ({exc})") from None


def _events(run_dir: Path) -> list[StragglerDetected]:
    """The event log's events the report reads: its StragglerDetected (absent: none; a
    long job's log holds millions of records, read through and let go). Messages the
    bus logged as invalid are skipped; bytes that are not a log record are an error."""
    from elaswave.bus.eventlog import read_event_log

    path = run_dir / EVENT_LOG
    if not path.is_file():
        return []
    events = []
    try:
        for record in read_event_log(path):
            if math.isnan(record.t):  # the file itself is damaged, not one message
                raise ValueError(f"{str(path)!r} is corrupt: {record.error}")
            if isinstance(record.event, StragglerDetected):
                events.append(record.event)
    except OSError as exc:
        raise ValueError(f"cannot read {str(path)!r}: {exc.strerror}") from None
    return events


def load_report(run_dir: Path) -> Report:
    """Read RUN_DIR's summary.json, job.json and events.log; ValueError says what is wrong."""
    if not run_dir.exists():
        raise ValueError(f"run directory {str(run_dir)!r} does not exist")
    if not run_dir.is_dir():
        raise ValueError(f"{str(run_dir)!r} is not a directory")
    path = run_dir / SUMMARY
    if not path.is_file():
        if (run_dir / JOB).is_file():
            raise ValueError(
                f"no {SUMMARY} in {str(run_dir)!r}: the job is still running or did not "
                f"finish (see `elaswave events {run_dir}`)"
            )
        raise ValueError(f"{str(run_dir)!r} is not a run directory (no {SUMMARY}, no {JOB})")
    summary = _read_json(path)
    report = build_report(
        summary,
        _initial_plan(run_dir),
        run_name=run_dir.resolve().name,
        events=_events(run_dir),
        source=repr(str(path)),
    )
    return dataclasses.replace(report, timeline=_timeline(run_dir))


def _timeline(run_dir: Path) -> tuple[TimelineRow, ...]:
    """The workers' traced actions (none when their results are missing or unreadable:
    the rest of the report does not need them)."""
    from elaswave.runtime.job.results import read_worker_results

    try:
        return timeline(read_worker_results(run_dir))
    except (OSError, ValueError):
        return ()


# --------------------------------------------------------------------------- drawing

_KIND_COLOURS: dict[str, str] = {
    RecoveryKind.FAIL_STOP: "tab:red",
    RecoveryKind.FAIL_SLOW: "tab:orange",
    RecoveryKind.JOIN: "tab:green",
}
_LABEL_BOX = {"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.8}


def render(report: Report, out: Path) -> None:
    """Draw the report to ``out`` (PNG) with matplotlib's Agg backend."""
    try:
        import matplotlib  # noqa: F401  (the plot extra: optional)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError(f"matplotlib is not installed; {PLOT_EXTRA}") from None

    rows, ranks = len(report.plans), len(report.timeline)
    heights = [3.2, 0.6 + 0.55 * rows] + ([0.8 + 0.3 * ranks] if ranks else [])
    fig = Figure(figsize=(11, 1.0 + sum(heights)), layout="constrained")
    FigureCanvasAgg(fig)  # Agg, without pyplot or a process-wide backend
    axes = fig.subplots(len(heights), 1, height_ratios=heights)
    fig.suptitle(report.title, fontsize=11, color="darkred" if report.emulated else "black")
    _draw_throughput(axes[0], report)
    _draw_plans(axes[1], report)
    if ranks:
        _draw_timeline(axes[2], report)
    metadata = {"Title": report.title, "Description": "\n".join(report.lines())}
    try:
        fig.savefig(out, format="png", dpi=100, metadata=metadata)
    except OSError as exc:
        raise ValueError(f"cannot write {str(out)!r}: {exc.strerror or exc}") from None


def _draw_throughput(ax: Any, report: Report) -> None:
    unit = "samples/s (EMULATED)" if report.emulated else "samples/s"
    ax.plot(report.steps, report.samples_per_s, marker="o", ms=3, lw=1.2, color="tab:blue")
    ax.set_xlabel("step")
    ax.set_ylabel(unit)
    ax.set_title(
        "throughput per step (global batch / step time); a solid line marks where a plan "
        "change took effect, a dotted one a straggler verdict",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0, top=max([r for r in report.samples_per_s if r > 0] or [1]) * 1.45)
    where = ax.get_xaxis_transform()  # x in steps, y in axes fractions
    for v in report.verdicts:
        ax.axvline(v.step, color="grey", ls=":", lw=1)
        ax.annotate(
            f"step {v.step}: {v.label}",
            (v.step, 0.02),
            xycoords=where,
            xytext=(3, 0),
            textcoords="offset points",
            rotation=90,
            fontsize=7,
            color="dimgrey",
            va="bottom",
            bbox=_LABEL_BOX,
        )
    for c in report.changes:
        colour = _KIND_COLOURS.get(c.kind, "tab:purple")
        x = c.step - 0.5  # between the last step on the old plan and the first on the new
        ax.axvline(x, color=colour, lw=1.6)
        ax.annotate(
            f"step {c.step}: {c.label}",
            (x, 0.98),
            xycoords=where,
            xytext=(3, 0),
            textcoords="offset points",
            rotation=90,
            fontsize=8,
            color=colour,
            va="top",
            bbox=_LABEL_BOX,
        )


def _draw_plans(ax: Any, report: Report) -> None:
    import matplotlib as mpl

    colours = mpl.colormaps["tab10"]
    labels = []
    for y, plan in enumerate(report.plans):
        labels.append(f"{plan.label} ({plan.schedule})" if plan.schedule else plan.label)
        for i, stage in enumerate(plan.stages):
            lo, hi = stage.layers
            ax.barh(y, hi - lo, left=lo, height=0.7, color=colours(i % 10), edgecolor="white")
            text = f"S{i} {stage.layer_text} dp{stage.dp}"
            if stage.mhz is not None:
                text += f" {stage.mhz:g} MHz"
            ax.text((lo + hi) / 2, y, text, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()  # the initial plan on top, changes below in order
    ax.set_xlim(0, max(s.layers[1] for p in report.plans for s in p.stages))
    ax.set_xlabel("layer")
    ax.set_title(
        "layers per pipeline stage [lo, hi), DP width and clock, before and after each change",
        fontsize=9,
    )


_OP_COLOURS = {"F": "tab:blue", "B": "tab:orange", "I": "tab:olive", "W": "tab:green"}


def _draw_timeline(ax: Any, report: Report) -> None:
    labels = []
    for y, row in enumerate(report.timeline):
        labels.append(f"r{row.rank} S{row.stage}")
        for op, mb, start, end in row.actions:
            ax.barh(y, end - start, left=start, height=0.7, color=_OP_COLOURS.get(op, "grey"),
                    edgecolor="white", linewidth=0.5)  # fmt: skip
            ax.text((start + end) / 2, y, f"{op}{mb}", ha="center", va="center", fontsize=5,
                    color="white", clip_on=True)  # fmt: skip
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the rank's step start" + (" (EMULATED)" if report.emulated else ""))
    steps = sorted({row.step for row in report.timeline})
    ax.set_title(
        f"actions of step {', '.join(map(str, steps))} per rank, initial plan: F forward, "
        "B backward, I input-gradient half, W weight-gradient half (waits for inputs "
        "included)",
        fontsize=9,
    )


# --------------------------------------------------------------------------- the command


def write_report(run_dir: Path, out: Path | None = None) -> int:
    """Read RUN_DIR, print its plan changes, and write the figure to ``out``."""
    report = load_report(run_dir)
    out = out if out is not None else run_dir / REPORT
    if out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a directory; give a file name such as report.png")
    if not out.parent.is_dir():
        raise ValueError(f"--out {str(out)!r}: directory {str(out.parent)!r} does not exist")
    render(report, out)
    if hasattr(sys.stdout, "reconfigure"):  # "→" on a terminal that cannot show it: "?"
        sys.stdout.reconfigure(errors="replace")
    for line in report.lines():
        print(line)
    print(f"elaswave: wrote {out}")
    return 0
