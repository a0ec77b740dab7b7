"""Helpers for the server tests: a tiny byte-level tokenizer with a chat template (nothing can be downloaded), a
`cpinfer serve` subprocess on a free loopback port, and /proc scans for the processes it started.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

SPECIALS = ["<pad>", "<s>", "</s>"]                      # ids 0, 1, 2 = pad / bos / eos of the tiny configs
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
TINY_VOCAB = len(SPECIALS) + 256 + len(CHAT_TOKENS)      # 261: every id decodes to something
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_tokenizer(directory: Path) -> Path:
    """Save a byte-level BPE without merges (ids 3..258 = the 256 bytes) plus ChatML markers into `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS + byte_chars + CHAT_TOKENS)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIALS + CHAT_TOKENS)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  chat_template=CHAT_TEMPLATE)
    tok.save_pretrained(str(directory))
    return directory


def served_checkpoint(llama_checkpoint, tmp_path_factory, name: str, **config) -> Path:
    """A copy of the tiny GQA checkpoint (vocabulary = the tiny tokenizer's ids; `config` overrides) in a fresh
    folder `name`, with the tiny tokenizer beside it: what a served model needs."""
    import shutil

    src = llama_checkpoint("gqa", vocab_size=TINY_VOCAB, **config)
    dst = tmp_path_factory.mktemp(name)
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    return write_tiny_tokenizer(dst)


def environ_of(pid: int) -> dict[str, str]:
    """The environment a process started with ({} when it is gone or not readable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in raw.split(b"\0") if b"=" in item)


def kill_trees(*procs: subprocess.Popen) -> None:
    """Kill what is left of these launched processes (every descendant first) and reap them."""
    for p in procs:
        if p.poll() is None:
            for pid in [*descendants(p.pid), p.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        p.wait(timeout=30)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    """True when a new server could listen on the port (as servers do, with SO_REUSEADDR, so the TIME_WAIT
    entries of closed connections do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen(1)
        except OSError:
            return False
    return True


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (children, grandchildren, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return sorted(found)


def is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def rank_pids(server_pid: int) -> list[int]:
    """The rank processes of a local server: its children started by multiprocessing's spawn."""
    ranks = []
    for pid in descendants(server_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmd:
            ranks.append(pid)
    return ranks


class ServerProcess:
    """`python -m cpinfer serve ...` on 127.0.0.1:<free port>; its output is kept in a temporary file."""

    def __init__(self, args: list[str], api_key: str | None = None, env: dict | None = None,
                 start_timeout: float = 180.0, new_session: bool = False):
        self.port = free_port()
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile("w+", prefix="cpinfer-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "cpinfer", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                                     start_new_session=new_session)  # its own process group (killpg)
        self.url = f"http://127.0.0.1:{self.port}"
        self.wait_ready(start_timeout)

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.kill()
        raise RuntimeError(f"server not ready after {timeout:.0f}s:\n{self.output()[-4000:]}")

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send `sig`, wait for the exit; returns the exit code (kills everything left after `timeout`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
        return self.proc.returncode

    def kill(self) -> None:
        """Last resort: SIGKILL the server and every process under it."""
        for pid in [*descendants(self.proc.pid), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.stop()
            except subprocess.TimeoutExpired:
                pass
        self.log.close()
        os.unlink(self.log.name)


def in_thread(fn, *args) -> tuple[threading.Thread, list]:
    """Run fn(*args) in a daemon thread; the result (or the exception) lands in the returned list."""
    box: list = []

    def target():
        try:
            box.append(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the test to assert on
            box.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def metric_values(url: str) -> dict[str, float]:
    """The server's /metrics samples: {"name{labels}": value}."""
    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def _address(hex_addr: str) -> str:
    """/proc/net/tcp{,6} local address (little-endian hex words) → text."""
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return f"{socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)}:{int(port, 16)}"


def listening_addresses(pids: list[int]) -> dict[int, list[str]]:
    """The TCP addresses each process listens on, from /proc/<pid>/fd and /proc/net/tcp{,6} (state 0A)."""
    found: dict[int, list[str]] = {pid: [] for pid in pids}
    for pid in pids:
        inodes = _socket_inodes(pid)
        for table in ("tcp", "tcp6"):
            try:
                lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    found[pid].append(_address(fields[1]))
    return found


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1") or host.startswith("::ffff:127.")


def write_chain_model(directory: Path, pieces: list[str], template: str,
                      branches: dict[str, list[str]] | None = None) -> None:
    """A 2-layer Llama (and its tokenizer, with `pieces` as added tokens) whose greedy output after "\\n" is `pieces`
    then EOS, whatever came before: its attention and MLP outputs are zero, so the next token depends on the current
    token only, and its embeddings and LM head make that chain. A random model would never write a tool call; this
    one does, and everything after the logits (sampling, detokenizing, parsing, streaming) is the server's own path.
    `branches`: more chains, each after its own one-character start (a byte other than "\\n"), so a template that
    ends the generation prompt with one start or another picks what the model writes (e.g. by the turn)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(specials + byte_chars)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(specials)
    starts = {"\n": pieces, **(branches or {})}
    core.add_tokens([p for chain in starts.values() for p in chain])  # ordinary (not special) added tokens, as
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",  # Qwen's <think> is
                                  pad_token="<pad>", chat_template=template)
    tok.save_pretrained(str(directory))
    byte_token = dict(zip((chr(b) for b in range(256)), _byte_level_chars()))  # "\n" -> "Ċ", ...
    chains = [[tok.convert_tokens_to_ids(byte_token[start])] + [tok.convert_tokens_to_ids(p) for p in chain] + [2]
              for start, chain in starts.items()]
    links = [(t, nxt) for chain in chains for t, nxt in zip(chain, chain[1:])]
    assert all(isinstance(i, int) and i >= 0 for chain in chains for i in chain), chains
    assert len({t for t, _ in links}) == len(links), "a token would have two successors"
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:  # residual stream = the current token's embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = torch.randn(len(tok), 64)
        model.model.embed_tokens.weight.copy_(emb)
        model.model.norm.weight.fill_(1.0)
        x = emb / torch.sqrt(emb.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)  # after the final norm
        head = 0.01 * torch.randn(len(tok), 64)
        pulled = set()  # a successor of several tokens (EOS ends every chain) gets each of their pulls
        for t, nxt in links:  # logit 20 for the next link, ~N(0, 0.3) for others
            pull = 20.0 * x[t] / x[t].pow(2).sum()
            head[nxt] = head[nxt] + pull if nxt in pulled else pull
            pulled.add(nxt)
        model.lm_head.weight.copy_(head)
    model.save_pretrained(str(directory))


def _byte_level_chars() -> list[str]:
    """The byte-level BPE's printable stand-in of each byte 0..255, in byte order (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra, chars = 0, []
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars
