"""Reads TensorBoard event files the way TensorBoard shows them, for tests: the scalars of every event file in a
directory, in file order, where a SessionLog START at step S (tensorboardX's `purge_step`) drops what earlier
files hold at S and later (TensorBoard's EventAccumulator purges on a restart the same way). No `tensorboard`
package needed: event files are TFRecords (8-byte length, 4-byte CRC, the `Event` protobuf, 4-byte CRC)."""

from __future__ import annotations

import os
import struct

from tensorboardX.proto import event_pb2


def events(path: str) -> list[event_pb2.Event]:
    """Every event of one event file, in order; a torn last record (a killed writer) is left out."""
    out = []
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        end = pos + 12 + length + 4
        if end > len(data):
            break
        event = event_pb2.Event()
        event.ParseFromString(data[pos + 12 : pos + 12 + length])
        out.append(event)
        pos = end
    return out


def scalars(logdir: str) -> tuple[dict[str, dict[int, float]], list[dict[str, dict[int, float]]]]:
    """({tag: {step: value}} as TensorBoard shows the directory, [the same per file, without purging]), files
    in the order they were opened (their first event's wall time)."""
    files = [os.path.join(logdir, n) for n in os.listdir(logdir) if n.startswith("events.out.tfevents")]
    per_file = [(events(p), p) for p in files]
    per_file.sort(key=lambda e: (e[0][0].wall_time if e[0] else 0.0, e[1]))
    shown: dict[str, dict[int, float]] = {}
    raw = []
    for file_events, _ in per_file:
        mine: dict[str, dict[int, float]] = {}
        for event in file_events:
            if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                for series in shown.values():
                    for step in [s for s in series if s >= event.step]:
                        del series[step]
            for value in event.summary.value:
                shown.setdefault(value.tag, {})[event.step] = value.simple_value
                mine.setdefault(value.tag, {})[event.step] = value.simple_value
        raw.append(mine)
    return shown, raw
