"""The command that starts what a plan describes: `cpinfer serve` on one node, or the torchrun line every node of a
multi-node deployment runs (TP inside a node, CP across nodes: global rank = cp_rank * tp + tp_rank, so the TP
ranks of a group are consecutive and a node holds whole TP groups, or a TP group spans whole nodes)."""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from cpinfer.perf.planner import Plan

DEFAULT_PORT = 8000
RDZV_PORT = 29500
HEAD = "HEAD_NODE"   # placeholder: the address of the node that serves HTTP (rank 0), reachable from every node
DTYPE_FLAGS = {2: "bfloat16", 4: "float32"}
# Catalog models whose FP8 checkpoint is published in a format the planner's weight formats describe.
FP8_CHECKPOINTS = {
    "llama3-405b": ("meta-llama/Llama-3.1-405B-Instruct-FP8", "fbgemm_fp8: row-wise FP8 MLPs, attention bf16"),
    "deepseek-v3": ("deepseek-ai/DeepSeek-V3", "published in block-wise FP8 (128 x 128 scales)"),
    "kimi-k2": ("moonshotai/Kimi-K2-Instruct", "published in block-wise FP8 (128 x 128 scales)"),
}
_HUB = re.compile(r"huggingface\.co/([\w.-]+/[\w.-]+)")


@dataclass(frozen=True)
class Launch:
    nodes: int
    procs_per_node: int
    command: str             # the same line on every node
    notes: tuple[str, ...]

    def to_dict(self) -> dict:
        return dict(nodes=self.nodes, procs_per_node=self.procs_per_node, command=self.command,
                    per_node=[dict(node=i, command=self.command) for i in range(self.nodes)], notes=list(self.notes))

    def lines(self) -> list[str]:
        if self.nodes == 1:
            head = f"launch    on one node ({self.procs_per_node} device{'s' if self.procs_per_node > 1 else ''}):"
        else:
            head = (f"launch    on each of the {self.nodes} nodes, the same line ({self.procs_per_node} processes "
                    f"per node; {HEAD} = the address of the node clients reach):")
        return [head, f"  {self.command}"] + [f"  note: {n}" for n in self.notes]


def node_layout(gpus: int, tp: int, devices_per_node: int) -> tuple[int, int]:
    """(nodes, processes per node): as many devices per node as the profile has, each node holding whole TP groups
    (or a TP group spanning whole nodes), every node the same."""
    if gpus <= devices_per_node:
        return 1, gpus
    for per_node in range(devices_per_node, 0, -1):
        if gpus % per_node == 0 and (per_node % tp == 0 or tp % per_node == 0):
            return gpus // per_node, per_node
    return gpus, 1  # unreachable: per_node = 1 always qualifies


def checkpoint_for(plan: Plan) -> tuple[str, str | None]:
    """What the command serves: a config.json's folder, or the catalog model's Hugging Face repository (its FP8
    one for an FP8 weight format, when published); plus a note when the choice needs the user's eye."""
    d = plan.deployment
    m = d.model
    source = Path(m.source)
    if source.name == "config.json" and source.is_file():
        return str(source.parent), None
    fp8 = d.weights.attn_fp8 or d.weights.ffn_fp8
    if fp8 and m.name in FP8_CHECKPOINTS:
        repo, fmt = FP8_CHECKPOINTS[m.name]
        return repo, f"{repo}: {fmt}"
    found = _HUB.search(m.source)
    if not found:
        return "MODEL", "replace MODEL by the checkpoint folder (or Hub id) of this model"
    note = f"{found.group(1)} holds bf16 weights; serve an FP8 checkpoint of it for --weights {d.weights.name}" \
        if fp8 else None
    return found.group(1), note


def serve_args(plan: Plan, checkpoint: str, port: int, hardware_arg: str | None, multinode: bool,
               pd: tuple[int, int] | None = None, spec_tokens: int | None = None) -> list[str]:
    d, w = plan.deployment, plan.workload
    args = ["--model", checkpoint, "--cp", str(d.cp), "--tp", str(d.tp),
            "--max-model-len", str(w.context_tokens), "--dtype", DTYPE_FLAGS.get(d.act_bytes, "auto")]
    if pd is not None:
        args += ["--pd-decode-cp", str(pd[0])] + (["--pd-decode-groups", str(pd[1])] if pd[1] > 1 else [])
    if spec_tokens:
        args += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": spec_tokens})]
    if d.fp8_kv:
        args += ["--kv-cache-dtype", "fp8_per_token" if d.kv_scale_bytes else "fp8"]
    if hardware_arg:
        args += ["--hardware-profile", hardware_arg]
    if multinode:
        args += ["--host", "0.0.0.0"]
    return args + ["--port", str(port)]


def launch_command(plan: Plan, checkpoint: str | None = None, port: int = DEFAULT_PORT,
                   hardware_arg: str | None = None, pd: tuple[int, int] | None = None,
                   spec_tokens: int | None = None) -> Launch:
    """The exact command line(s) that start the planned deployment. `hardware_arg`: the profile name or path to
    hand the engine's cost model (`--hardware-profile`); `pd`: (decode CP size, decode groups) when prefill and
    decode run on separate groups ((N + K x M) x TP devices); `spec_tokens`: k of n-gram speculative decoding."""
    d = plan.deployment
    gpus = d.gpus if pd is None else (d.cp + pd[0] * pd[1]) * d.tp
    nodes, per_node = node_layout(gpus, d.tp, d.hardware.devices_per_node)
    note = None
    if checkpoint is None:
        checkpoint, note = checkpoint_for(plan)
    serve = serve_args(plan, checkpoint, port, hardware_arg, nodes > 1, pd, spec_tokens)
    if nodes == 1:
        command = shlex.join(["cpinfer", "serve", *serve])
    else:
        command = shlex.join(["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(per_node),
                              "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{HEAD}:{RDZV_PORT}",
                              "--rdzv-id", "cpinfer-serve", "-m", "cpinfer", "serve", *serve])
    notes = [n for n in (note,) if n]
    m = d.model
    if not plan.memory.fits:
        notes.append("weights + KV exceed the usable device memory: the engine will stop at start-up with no room "
                     "for this KV cache")
    if m.max_context and plan.workload.context_tokens > m.max_context:
        notes.append(f"--max-model-len above {m.name}'s max_position_embeddings ({m.max_context}): the engine "
                     "starts with a warning; quality at this length needs RoPE scaling in the checkpoint's "
                     "config.json")
    if not d.decode_graphs:
        notes.append(f"decode runs without CUDA graphs: the engine captures none with {d.eager_decode_reason}")
    return Launch(nodes, per_node, command, tuple(notes))
