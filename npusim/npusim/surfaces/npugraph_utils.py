"""torch_npu's ``torch_npu.npu._npugraph_utils``: ``align_trace_json``, which ``NPUGraph.debug_dump``
calls after a dump to write a derived ``<stem>.aligned.json`` beside it.

torch_npu's aligns a Chrome trace of the graph's tasks (streams merged, timestamps rebuilt,
record/wait pairs lined up).  The simulator's dump is its own JSON of the graph's nodes in
order; aligned, each node gets a start and duration on one time line (0.2 apart, as
torch_npu spaces tasks), and each ExternalEvent wait is paired with the records of its event.
The raw dump is never changed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["align_trace_json"]

_GAP = 0.2  # torch_npu's fixed visualisation gap between tasks of a stream


def align_trace_json(path: str, out_path: str | None = None) -> str:
    """Write the aligned form of the dump at ``path`` to ``out_path`` (default
    ``<stem>.aligned.json`` beside it); returns where it wrote."""
    src = Path(path)
    doc: dict[str, Any] = json.loads(src.read_text())
    ts = 0.0
    events = []
    records: dict[Any, list[int]] = {}
    for node in doc.get("nodes", []):
        kind = node.get("kind", "")
        dur = 0.2 if "Wait" in kind or "Record" in kind else 1.0
        events.append({**node, "ts": ts, "dur": dur})
        if "Record" in kind:
            records.setdefault(node.get("event"), []).append(node["index"])
        ts += dur + _GAP
    for ev in events:
        if "Wait" in ev.get("kind", ""):
            ev["recorded_by"] = records.get(ev.get("event"), [])
    target = Path(out_path) if out_path is not None else src.with_name(f"{src.stem}.aligned.json")
    target.write_text(json.dumps({**doc, "nodes": events}, indent=1))
    return str(target)
