"""Runs the GPU check's parts in order within one time budget (`scripts/gpu_check.sh`): each part in its own process
under its own limit, a part that would not fit skipped with one line, the report rewritten after every part and
every part's output kept in one archive, so that a call cut short still leaves what it measured.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

from cpinfer.bench import gpu_results as R

PROGRESS = re.compile(r"^\([a-z]\) ")  # a part's progress lines: shown; the rest goes to its log only
REPORT_RESERVE_S = 10  # kept for the last report and the archive


def plan(parts, only: list[str] | None) -> list:
    """The parts to run, in the check's order: all, or those named in `only`."""
    if not only:
        return list(parts)
    names = {p.name for p in parts}
    unknown = [n for n in only if n not in names]
    if unknown:
        raise ValueError(f"unknown part(s) {', '.join(unknown)}; parts: {', '.join(p.name for p in parts)}")
    return [p for p in parts if p.name in only]


def run_all(parts, out: Path, budget_s: float, only: list[str] | None, script: str, env: dict,
            device: str, versions: str) -> bool:
    """Every planned part that fits the budget, then the report → True when every part of this call ran and
    passed."""
    t0 = time.monotonic()
    command = f"{script} {shlex.quote(str(out))}" + (f" --only {','.join(only)}" if only else "")
    out.mkdir(parents=True, exist_ok=True)
    order = [(p.name, p.title) for p in parts]
    data = R.load(out)
    data.update(device=device, versions=versions)
    R.save(out, data)
    logs = Path(tempfile.mkdtemp(prefix="gpu_check_logs_"))
    _restore_logs(out, logs)
    console = open(logs / "console.log", "a")

    def say(line: str) -> None:
        print(line, flush=True)
        console.write(line + "\n")
        console.flush()

    say(f"gpu_check: {device}; budget {budget_s:.0f} s; results in {out}/ ({R.REPORT}, {R.RESULTS}, {R.LOGS})")
    skipped = []
    for part in plan(parts, only):
        left = budget_s - (time.monotonic() - t0) - REPORT_RESERVE_S
        if part.limit_s > left:
            skipped.append(part.name)
            reason = f"skipped: needs up to {part.limit_s} s, {max(0, left):.0f} s of the {budget_s:.0f} s budget left"
            R.update_part(out, part.name, status="skipped", reason=reason, limit_s=part.limit_s, seconds=None)
            say(f"== ({part.name}) {part.title}: SKIPPED (needs up to {part.limit_s} s, {max(0, left):.0f} s left)")
            continue
        say(f"== ({part.name}) {part.title} (at most {part.limit_s} s)")
        status, seconds = run_part_process(part, out, logs, env, say)
        say(f"== ({part.name}) {R.STATUS_WORDS.get(status, status)} in {seconds:.0f} s")
        _finish_step(out, order, logs)
    data = R.load(out)
    data["runs"].append({"command": command, "seconds": time.monotonic() - t0, "date": time.strftime("%Y-%m-%d")})
    R.save(out, data)
    R.write_report([out], order)
    statuses = R.load(out)["parts"]
    ok = all(statuses[p.name].get("status") == "pass" for p in plan(parts, only))  # this call's parts
    if skipped:
        say(f"gpu_check: skipped {','.join(skipped)}; run them with: {follow_up(script, out, skipped)}")
    say(f"gpu_check: {'PASS' if ok else 'FAIL'} in {time.monotonic() - t0:.0f} s; report: {out / R.REPORT}")
    console.close()
    _archive_logs(out, logs)
    return ok


def follow_up(script: str, out: Path, skipped: list[str]) -> str:
    """The command that runs exactly the skipped parts, into a directory of its own (so that both come back and
    `report --from` merges them)."""
    return f"{script} {shlex.quote(str(out).rstrip('/') + '-2')} --only {','.join(skipped)}"


def part_command(name: str, out: Path, logs: Path) -> list[str]:
    return [sys.executable, "-u", "-m", "cpinfer.bench.gpu_check", "run", name, "--out", str(out), "--logs", str(logs)]


def run_part_process(part, out: Path, logs: Path, env: dict, say) -> tuple[str, float]:
    """One part in its own process group, killed at its limit; its progress lines relayed, all of its output in
    LOGS/<part>.log → (status, seconds)."""
    t0 = time.monotonic()
    R.update_part(out, part.name, status="running", limit_s=part.limit_s, seconds=None, reason=None, error=None,
                  tables=[], failures=[], markdown=None)
    cmd = part_command(part.name, out, logs)
    log = open(logs / f"{part.name}.log", "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    relay = threading.Thread(target=_relay, args=(proc.stdout, log, say), daemon=True)
    relay.start()
    try:
        rc = proc.wait(timeout=part.limit_s)
    except subprocess.TimeoutExpired:
        rc = None
        _kill_group(proc)
    relay.join(timeout=10)
    log.close()
    seconds = time.monotonic() - t0
    status = R.load(out)["parts"][part.name].get("status")
    if rc is None:
        R.update_part(out, part.name, status="timeout", seconds=seconds,
                      error=f"killed at its {part.limit_s} s limit; the rows above were measured before")
        return "timeout", seconds
    if status == "running":  # the process died before writing its result
        R.update_part(out, part.name, status="crashed", seconds=seconds,
                      error=f"exit {rc}; last output:\n" + _tail(logs / f"{part.name}.log"))
        return "crashed", seconds
    R.update_part(out, part.name, seconds=seconds)  # the process's wall time (imports included): what the budget saw
    return status, seconds


def _relay(stream, log, say) -> None:
    for line in stream:
        log.write(line)
        log.flush()
        if PROGRESS.match(line):
            say("   " + line.rstrip())


def _kill_group(proc) -> None:
    """SIGTERM to the part's process group (its ranks and test runs too), SIGKILL 10 s later."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def _finish_step(out: Path, order, logs: Path) -> None:
    R.write_report([out], order)
    _archive_logs(out, logs)


def _archive_logs(out: Path, logs: Path) -> None:
    """Every log so far into DIR/logs.tar.gz (rewritten whole; temp file renamed)."""
    tmp = out / f".{R.LOGS}.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for f in sorted(logs.iterdir()):
            tar.add(f, arcname=f"logs/{f.name}")
    os.replace(tmp, out / R.LOGS)


def _restore_logs(out: Path, logs: Path) -> None:
    """A previous call's logs in DIR/logs.tar.gz are kept: unpacked beside this call's."""
    if (out / R.LOGS).exists():
        with tarfile.open(out / R.LOGS) as tar:
            for m in tar.getmembers():
                name = m.name.removeprefix("logs/")
                if m.isfile() and "/" not in name and not name.startswith("."):
                    (logs / name).write_bytes(tar.extractfile(m).read())
