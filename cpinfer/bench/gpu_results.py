"""The GPU check's results as they are measured: one JSON file (every part's rows, written at once, row by row) and
the markdown report made from it, on the GPU machine after every part or at home from the files that came back.
Needs no GPU: `python -m cpinfer.bench.gpu_check report --from DIR` runs wherever the files came back to.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

RESULTS = "results.json"  # every part: status, seconds, tables of rows, notes, failures, error
REPORT = "gpu_check.md"
LOGS = "logs.tar.gz"  # every part's full output
FORMAT = 1


def load(out: Path) -> dict:
    """DIR/results.json, or an empty record."""
    path = Path(out) / RESULTS
    if not path.exists():
        return {"format": FORMAT, "runs": [], "parts": {}}
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: results format {data.get('format')!r}, this cpinfer reads {FORMAT}")
    return data


def save(out: Path, data: dict) -> None:
    """Write DIR/results.json whole and atomically (a temp file renamed): a process killed mid-write leaves the
    previous version."""
    out = Path(out)
    fd, tmp = tempfile.mkstemp(prefix=".results-", dir=out)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would make the copied-back file private
    os.replace(tmp, out / RESULTS)


def update_part(out: Path, name: str, **fields) -> dict:
    """Merge `fields` into part `name`'s record in DIR/results.json → the part's record."""
    data = load(out)
    part = data["parts"].setdefault(name, {"tables": [], "failures": []})
    part.update(fields)
    save(out, data)
    return part


class Recorder:
    """One part's rows, each saved to DIR/results.json as soon as it is measured and announced in one progress line
    (`(b) attention TFLOP/s: 8192 | triton | ...`); a failed comparison is a row of its own that fails the part
    without discarding the others."""

    def __init__(self, out: Path, part: str, logs: Path | None = None):
        self.out, self.part = Path(out), part
        self.logs = Path(logs) if logs is not None else self.out  # where a part's side files go (a profile, logs)
        self.tables: list[dict] = []
        self.failures: list[str] = []

    def row(self, table: str, header: list[str], cells: list) -> None:
        t = next((t for t in self.tables if t["name"] == table), None)
        if t is None:
            t = {"name": table, "header": list(header), "rows": []}
            self.tables.append(t)
        if len(cells) != len(t["header"]):
            raise ValueError(f"table {table!r}: {len(cells)} cells for {len(t['header'])} columns")
        t["rows"].append([str(c) for c in cells])
        self._save()
        print(f"({self.part}) {table}: " + " | ".join(str(c) for c in cells), flush=True)

    def fail(self, message: str) -> None:
        self.failures.append(message)
        self._save()
        print(f"({self.part}) FAIL: {message}", flush=True)

    def check(self, ok: bool, message: str) -> bool:
        """`fail(message)` unless `ok`; → ok."""
        if not ok:
            self.fail(message)
        return ok

    def _save(self) -> None:
        update_part(self.out, self.part, tables=self.tables, failures=self.failures)


# ---------------------------------------------------------------- the report

def table_md(header: list[str], rows: list[list]) -> str:
    def cell(c) -> str:
        return str(c).replace("|", "\\|")  # a literal | inside a markdown table cell

    lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(cell, r)) + " |" for r in rows])


STATUS_WORDS = {"pass": "PASS", "fail": "FAIL", "timeout": "FAIL, timed out", "skipped": "SKIPPED",
                "running": "FAIL, did not finish", "crashed": "FAIL, crashed"}


def merge(records: list[dict]) -> dict:
    """Several calls' results as one (e.g. the first call and its `--only` follow-up): per part, the last record
    that ran it; the runs of all."""
    merged = {"format": FORMAT, "runs": [], "parts": {}}
    for rec in records:
        merged["runs"] += rec.get("runs", [])
        for k in ("device", "versions"):
            merged[k] = rec.get(k) or merged.get(k)
        for name, part in rec.get("parts", {}).items():
            if part.get("status") != "skipped" or name not in merged["parts"]:
                merged["parts"][name] = part
    return merged


def render(data: dict, order: list[tuple[str, str]]) -> tuple[bool, str]:
    """(every part passed, the markdown report) from a results record; `order`: (name, title) of every part."""
    runs = data.get("runs", [])
    head = [f"### GPU: {data.get('device', 'unknown device')}", ""]
    head += ["```"] + [f"{r['command']}    # {r['date']}, {r['seconds']:.0f} s" for r in runs] + ["```", ""]
    head += [data.get("versions", ""), ""]
    body, ok = [], True
    for name, title in order:
        part = data["parts"].get(name)
        status = (part or {}).get("status", "not run")
        ok &= status == "pass"
        secs = f", {part['seconds']:.0f} s" if part and part.get("seconds") is not None else ""
        limit = f" (limit {part['limit_s']} s)" if part and part.get("limit_s") else ""
        body += [f"#### ({name}) {title}: {STATUS_WORDS.get(status, status.upper())}{secs}{limit}", ""]
        body += _part_body(part or {})
    overall = "PASS" if ok else "FAIL"
    return ok, "\n".join(head + [f"Overall: {overall}", ""] + body).rstrip() + "\n"


def _part_body(part: dict) -> list[str]:
    lines = []
    if part.get("reason"):
        lines += [part["reason"], ""]
    for t in part.get("tables", []):
        lines += [f"{t['name']}:", "", table_md(t["header"], t["rows"]), ""]
    if part.get("markdown"):
        lines += [part["markdown"], ""]
    if part.get("failures"):
        lines += ["Failed:", ""] + [f"- {f}" for f in part["failures"]] + [""]
    if part.get("error"):
        lines += ["```", part["error"][-3000:].rstrip(), "```", ""]
    return lines


def write_report(dirs: list[Path], order: list[tuple[str, str]], write_doc: Path | None = None,
                 report_to: Path | None = None) -> tuple[bool, str]:
    """The report of the results in `dirs` (merged in order) → DIR/gpu_check.md of the last (or `report_to`), and,
    asked, the "GPU" section of `write_doc`."""
    missing = [str(d) for d in dirs if not (Path(d) / RESULTS).exists()]
    if missing:
        raise ValueError(f"no {RESULTS} in {', '.join(missing)} (the directory a gpu_check.sh call wrote)")
    ok, text = render(merge([load(d) for d in dirs]), order)
    (Path(report_to) if report_to else Path(dirs[-1]) / REPORT).write_text(text)
    if write_doc is not None:
        from cpinfer.bench.attention import write_doc_section

        write_doc_section(Path(write_doc), "gpu", text)
    return ok, text
