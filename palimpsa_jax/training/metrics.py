"""Where the numbers of a run go: TensorBoard event files, `metrics.jsonl` (one line per logged
step, the record that resumed runs are compared with) and the final `metrics.json`.

A resumed run first truncates both records to its checkpoint's step, so every step appears
once. Only process 0 writes (`enabled=False` elsewhere).
"""
from __future__ import annotations

import json
import math
import pathlib
import time

import numpy as np
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter


def _float(value) -> float:
    return float(np.asarray(value))


class MetricWriter:
    """Scalars to TensorBoard (workdir/tensorboard) and workdir/metrics.jsonl."""

    def __init__(self, workdir: pathlib.Path, *, enabled: bool = True):
        self.workdir, self.enabled = pathlib.Path(workdir), enabled
        self.jsonl = self.workdir / "metrics.jsonl"
        events = self.workdir / "tensorboard"
        self._earlier_event_files = sorted(events.glob("events.out.tfevents.*"))
        self._events = EventFileWriter(str(events)) if enabled else None

    def truncate(self, step: int) -> None:
        """Drops what was logged after `step` (a resumed run logs it again): the lines of
        metrics.jsonl, and the events of earlier TensorBoard files, whose events up to `step`
        move into this run's file."""
        if not self.enabled:
            return
        if self.jsonl.exists():
            kept = [r for r in self.records() if r["step"] <= step]
            self.jsonl.write_text("".join(json.dumps(r) + "\n" for r in kept))
        for path in self._earlier_event_files:
            for event in LegacyEventFileLoader(str(path)).Load():   # as written (no migration)
                if event.HasField("summary") and event.step <= step:
                    self._events.add_event(event)
            path.unlink()
        self._earlier_event_files = []

    def records(self) -> list[dict]:
        """The lines of metrics.jsonl."""
        if not self.jsonl.exists():
            return []
        return [json.loads(line) for line in self.jsonl.read_text().splitlines() if line]

    def scalars(self, step: int, scalars: dict, *, record: bool = True) -> None:
        """Writes scalars (name -> number) at `step`; record=False keeps them out of
        metrics.jsonl (used for the many per-head diagnostics)."""
        if not self.enabled:
            return
        values = {name: _float(v) for name, v in scalars.items()}
        summary = summary_pb2.Summary(value=[
            summary_pb2.Summary.Value(tag=name, simple_value=v) for name, v in values.items()])
        self._events.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
        if record:
            with self.jsonl.open("a") as f:
                f.write(json.dumps({"step": step, **{k: (v if math.isfinite(v) else str(v))
                                                     for k, v in values.items()}}) + "\n")

    def histogram(self, step: int, tag: str, edges, counts) -> None:
        """A TensorBoard histogram at `step`: counts (K,) of the bins between edges (K + 1,)."""
        if not self.enabled:
            return
        edges, counts = np.asarray(edges, np.float64), np.asarray(counts, np.float64)
        centres = (edges[1:] + edges[:-1]) / 2
        total = counts.sum()
        histogram = summary_pb2.HistogramProto(
            min=float(edges[0]), max=float(edges[-1]), num=float(total),
            sum=float((centres * counts).sum()), sum_squares=float((centres**2 * counts).sum()),
            bucket_limit=edges[1:].tolist(), bucket=counts.tolist())
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, histo=histogram)])
        self._events.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def final(self, metrics: dict) -> None:
        """workdir/metrics.json: the run's final metrics."""
        if self.enabled:
            (self.workdir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")

    def flush(self) -> None:
        if self.enabled:
            self._events.flush()

    def close(self) -> None:
        if self.enabled:
            self._events.close()
