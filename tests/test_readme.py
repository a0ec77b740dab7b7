"""README.md's examples run as written on the embedded model: every ```python / ```bash block is extracted and run
(the server example against a `cpinfer serve` this test starts on a free loopback port). Setup steps are skipped by
an explicit list, each with its reason; a block the test does not know fails it, so a new example gets run too.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from server_utils import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
README_PORT = "8000"          # the port the README's server examples use; replaced by the test server's port

# Commands that set up a machine rather than show the package: run by hand, never from a test.
SKIPPED = {
    "bash scripts/demo.sh": "quick-start setup: creates .venv and installs torch, cpinfer and the model "
                            "(`cpinfer demo`, which it then runs, is tested in test_cli.py)",
    "bash scripts/test.sh": "quick-start step 2 runs this very test suite",
}


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block of a Markdown text, in order."""
    return [(lang, body) for lang, body in FENCE.findall(text)]


def _command(line: str) -> str:
    return line.split("#", 1)[0].strip()


def is_setup(body: str) -> bool:
    return all(_command(line) in SKIPPED for line in body.splitlines() if _command(line))


def serve_line(body: str) -> str | None:
    """The `cpinfer serve ...` line of a shell block, if it has one."""
    return next((line for line in body.splitlines() if _command(line).startswith("cpinfer serve")), None)


def serve_args(line: str) -> list[str]:
    """The arguments of a README `cpinfer serve` line, less the port (the test picks a free one)."""
    args = _command(line).split()[2:]
    if "--port" in args:
        i = args.index("--port")
        del args[i:i + 2]
    return args


def needs_server(lang: str, body: str) -> bool:
    return lang == "python" and f":{README_PORT}/" in body


def classify(blocks: list[tuple[str, str]]) -> dict[str, list]:
    groups: dict[str, list] = {"setup": [], "server": [], "client": [], "script": [], "unknown": []}
    for lang, body in blocks:
        if lang in ("bash", "sh", "shell") and is_setup(body):
            groups["setup"].append(body)
        elif lang in ("bash", "sh", "shell") and serve_line(body):
            groups["server"].append(body)
        elif needs_server(lang, body):
            groups["client"].append(body)
        elif lang == "python":
            groups["script"].append(body)
        else:
            groups["unknown"].append((lang, body))
    return groups


def run_python(body: str, tmp_path: Path, name: str, timeout: float = 600) -> str:
    script = tmp_path / f"{name}.py"
    script.write_text(body)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"README block {name} failed:\n{body}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done.stdout


def on_port(body: str, port: int) -> str:
    return body.replace(f"localhost:{README_PORT}", f"127.0.0.1:{port}").replace(
        f"127.0.0.1:{README_PORT}", f"127.0.0.1:{port}")


BLOCKS = code_blocks(README.read_text())
GROUPS = classify(BLOCKS)


def test_every_readme_block_is_known():
    assert BLOCKS, "no code block found in README.md"
    assert not GROUPS["unknown"], f"README blocks this test does not know how to run: {GROUPS['unknown']}"
    skipped = sorted(_command(line) for body in GROUPS["setup"] for line in body.splitlines() if _command(line))
    print("skipped README commands:\n" + "\n".join(f"  {c}: {SKIPPED[c]}" for c in skipped))
    assert skipped == sorted(SKIPPED), "a setup command listed here is no longer in README.md"
    assert GROUPS["server"] and GROUPS["client"] and GROUPS["script"]


@pytest.mark.parametrize("index", range(len(GROUPS["script"])))
def test_readme_python_example_runs(index, tmp_path):
    out = run_python(GROUPS["script"][index], tmp_path, f"readme_script_{index}")
    body = GROUPS["script"][index]
    if "llm.chat(" in body:  # the engine example prints texts, cached tokens per chat, cache stats
        texts = re.search(r"^\[.*?\] \[(\d+), (\d+)\]", out, re.M)
        assert texts, out
        assert int(texts.group(2)) > 0, "the second chat did not reuse the document's prefix"


def test_readme_server_examples(tmp_path):
    (server_block,) = GROUPS["server"]
    server = ServerProcess(serve_args(serve_line(server_block)), start_timeout=300)
    try:
        shell = "\n".join(line for line in server_block.splitlines() if line != serve_line(server_block))
        done = subprocess.run(["bash", "-ec", on_port(shell, server.port)], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
        reply = json.loads(done.stdout)
        assert reply["choices"][0]["message"]["content"], reply
        for i, body in enumerate(GROUPS["client"]):
            out = run_python(on_port(body, server.port), tmp_path, f"readme_client_{i}")
            if "cached_tokens" in body:
                assert int(out.split()[-1]) > 0, f"turn 2 reused no cached token: {out}"
    finally:
        server.close()
