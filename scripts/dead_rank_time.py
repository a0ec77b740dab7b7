"""How fast a dead rank is seen: `cpinfer serve --cp 2` on the embedded model with six streaming completions of 300
tokens under way, then `kill -9` of rank 1 (the server's child process); prints the seconds until /health stops
answering 200. Not a test (it times a machine): docs/benchmarks.md ("A dead rank") has its results.

usage: python scripts/dead_rank_time.py MODE RUNS [DRAFT_FOLDER]
  MODE: plain | ngram | draft (a draft model: DRAFT_FOLDER, e.g. the embedded model's converted folder under
  ~/.cache/cpinfer/models/)"""
import json, os, signal, socket, subprocess, sys, threading, time, urllib.request
import psutil

MODEL = sys.argv[3] if len(sys.argv) > 3 else None
mode, runs = sys.argv[1], int(sys.argv[2])

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def health(port):
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception:
        return None

def stream(port, stop):
    body = json.dumps({"model": "m", "prompt": "Tell me a long story about a lighthouse keeper. " * 20,
                       "max_tokens": 300, "stream": True, "temperature": 0, "ignore_eos": True}).encode()
    try:
        r = urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                   {"Content-Type": "application/json"}), timeout=120)
        for line in r:
            if stop.is_set():
                break
    except Exception:
        pass

for run in range(runs):
    port = free_port()
    cmd = [sys.executable, "-m", "cpinfer", "serve", "--cp", "2", "--port", str(port), "--host", "127.0.0.1",
           "--served-model-name", "m"]
    if mode == "ngram":
        cmd += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4})]
    elif mode == "draft":
        cmd += ["--speculative-config", json.dumps({"model": MODEL, "num_speculative_tokens": 4})]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while health(port) != 200:
        if time.time() - t0 > 300 or server.poll() is not None:
            sys.exit(f"server did not start ({server.poll()})")
        time.sleep(0.5)
    stop = threading.Event()
    threads = [threading.Thread(target=stream, args=(port, stop), daemon=True) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(8)  # streams under way
    kids = psutil.Process(server.pid).children(recursive=True)
    ranks = [k for k in kids if "python" in k.name() and "resource_tracker" not in " ".join(k.cmdline())]
    victim = ranks[0] if ranks else None
    if victim is None:
        sys.exit("no rank process found")
    tk = time.time()
    os.kill(victim.pid, signal.SIGKILL)
    while health(port) == 200 and time.time() - tk < 60:
        time.sleep(0.02)
    seen = time.time() - tk
    print(f"{mode} run {run}: /health not 200 after {seen:.2f} s (load {os.getloadavg()[0]:.1f}, victim pid "
          f"{victim.pid} of {len(ranks)} child python processes)", flush=True)
    stop.set()
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()
    for k in kids:
        try:
            k.kill()
        except Exception:
            pass
