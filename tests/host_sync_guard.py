"""A recorder of host work inside a rank's layer loop (tests only), for "every index reaches the device before layer
0; inside the layers no host→device copy and no host synchronisation".

On CPU the host is the device, so the recorder looks for what would cost a transfer or a sync on a GPU: tensors
made from host data (`torch.tensor`, `torch.as_tensor`, `torch.from_numpy` → `aten.lift_fresh` or the call
itself), reads of device values on the host (`.item()`, `bool(t)`, `.tolist()`, `.numpy()`, `.cpu()`,
`np.asarray(t)`), explicit moves (`.to(device)`, `.cuda()`, `.pin_memory()`), and ops whose output size depends on
the data (`nonzero`, boolean indexing, `masked_select`, `unique`, `repeat_interleave` without an output size). It is
active from layer 0's forward pre-hook to the last layer's forward hook of the rank's model; kernels of Triton's CPU
interpreter (numpy inside) run with recording paused. Uploads (`ForwardTables`, the static decode path's
`StaticBuffers`) are counted per forward.
"""
from __future__ import annotations

import contextlib
import traceback

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_SYNC_OPS = {aten.item.default, aten._local_scalar_dense.default, aten.is_nonzero.default, aten.nonzero.default,
             aten.masked_select.default, aten._unique2.default, aten.unique_consecutive.default,
             aten.unique_dim.default, aten.lift_fresh.default}
_REPEAT = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}


def _bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices if i is not None)


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.events: list[str] = []
        self.paused = 0

    def note(self, what: str) -> None:
        if not self.paused:
            where = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[-8:-2]
                     if "host_sync_guard" not in f.filename]
            self.events.append(f"{what} at {' <- '.join(reversed(where))}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNC_OPS:
            self.note(str(func))
        elif func in _REPEAT and kwargs.get("output_size") is None:
            self.note(f"{func} without output_size")
        elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and _bool_index(args[1]):
            self.note(f"{func} with a boolean index")
        return func(*args, **kwargs)


_GUARD: dict = {"recorder": None, "patches": None}


def _wrap(owner, name, check=None):
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        rec = _GUARD["recorder"]
        if rec is not None and (check is None or check(*args, **kwargs)):
            rec.note(f"{getattr(owner, '__name__', owner)}.{name}")
        return real(*args, **kwargs)

    return real, wrapper


def _has_device(self, *args, **kwargs) -> bool:
    return "device" in kwargs or any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args)


_TARGETS = [(torch, "from_numpy", None), (torch, "as_tensor", None), (torch, "asarray", None),
            (torch.Tensor, "tolist", None), (torch.Tensor, "numpy", None), (torch.Tensor, "cpu", None),
            (torch.Tensor, "__array__", None), (torch.Tensor, "cuda", None), (torch.Tensor, "pin_memory", None),
            (torch.Tensor, "to", _has_device)]


def _start(*_):
    rec = Recorder()
    _GUARD["recorder"] = rec
    _GUARD["patches"] = []
    for owner, name, check in _TARGETS:
        real, wrapper = _wrap(owner, name, check)
        setattr(owner, name, wrapper)
        _GUARD["patches"].append((owner, name, real))
    rec.__enter__()


def _stop(*_):
    rec = _GUARD["recorder"]
    if rec is None:
        return
    rec.__exit__(None, None, None)
    for owner, name, real in reversed(_GUARD["patches"]):
        setattr(owner, name, real)
    _GUARD["recorder"] = None
    _GUARD["log"].append({"events": rec.events})


@contextlib.contextmanager
def paused():
    rec = _GUARD["recorder"]
    if rec is not None:
        rec.paused += 1
    try:
        yield
    finally:
        if rec is not None:
            rec.paused -= 1


class _PausedKernel:
    """A Triton kernel whose launches run with recording paused (the interpreter computes with numpy)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            with paused():
                return launch(*args, **kwargs)

        return run


def _count_uploads(cls, moves) -> None:
    """Patch cls.upload (once) to record, for each call that moves data (`moves(self)`), whether it came before
    the layers or inside them."""
    if getattr(cls.upload, "counted", False):
        return
    real = cls.upload

    def upload(self):
        if moves(self):
            _GUARD["uploads"].append("inside the layers" if _GUARD["recorder"] is not None else "before")
        return real(self)

    upload.counted, upload.real = True, real
    cls.upload = upload


def install(ctx) -> None:
    """On a rank (a function for `pool.run`): record host work in every forward of its model runner."""
    from cpinfer.attention.tables import ForwardTables
    from cpinfer.engine.model_runner import ModelRunner

    runner = ctx.state["runner"]
    if _GUARD.get("installed") is runner:
        return
    _GUARD.update(installed=runner, log=[], uploads=[])
    layers = runner.model.model.layers
    layers[0].register_forward_pre_hook(_start)
    layers[-1].register_forward_hook(_stop)
    from cpinfer.engine.decode_tables import StaticBuffers

    _count_uploads(ForwardTables, lambda tables: bool(tables.pending))  # an upload with nothing pending moves nothing
    _count_uploads(StaticBuffers, lambda buffers: True)
    if not getattr(ModelRunner.execute, "counted", False):
        real_execute = ModelRunner.execute

        def execute(self, batch):
            _GUARD["uploads"].append("forward")
            res = real_execute(self, batch)
            if res.idle:  # no token here and no ring to serve (issue 18): the model did not run, nothing is due
                _GUARD["uploads"].append("idle")
            return res

        execute.counted, execute.real = True, real_execute
        ModelRunner.execute = execute
    try:
        from cpinfer.attention import triton_attention, triton_merge

        for mod, name in ((triton_attention, "_step_kernel"), (triton_merge, "_merge_kernel")):
            if not isinstance(getattr(mod, name), _PausedKernel):
                setattr(mod, name, _PausedKernel(getattr(mod, name)))
    except ImportError:
        pass


def uninstall(ctx) -> None:
    """On a rank: undo `install`'s patches of shared code (the hooks go with the runner's model)."""
    from cpinfer.attention.tables import ForwardTables
    from cpinfer.engine.decode_tables import StaticBuffers
    from cpinfer.engine.model_runner import ModelRunner

    for cls, name in ((ForwardTables, "upload"), (StaticBuffers, "upload"), (ModelRunner, "execute")):
        fn = getattr(cls, name)
        if getattr(fn, "counted", False):
            setattr(cls, name, fn.real)
    try:
        from cpinfer.attention import triton_attention, triton_merge

        for mod, name in ((triton_attention, "_step_kernel"), (triton_merge, "_merge_kernel")):
            if isinstance(getattr(mod, name), _PausedKernel):
                setattr(mod, name, getattr(mod, name).kernel)
    except ImportError:
        pass
    _GUARD.pop("installed", None)


def collect(ctx) -> dict:
    """On a rank: what was recorded since `install` (and clear it): events per forward, uploads per forward."""
    log, marks = _GUARD.get("log", []), _GUARD.get("uploads", [])
    _GUARD["log"], _GUARD["uploads"] = [], []
    per_forward, cur = [], None
    for m in marks:
        if m == "forward":
            cur = {"before": 0, "inside the layers": 0}
            per_forward.append(cur)
        elif m == "idle":  # an idle forward uploads nothing at all, and is not counted
            assert per_forward.pop() == {"before": 0, "inside the layers": 0}, "an idle rank uploaded tables"
        else:
            cur[m] += 1
    return {"layer_loops": log, "uploads": per_forward}


def inject_item(ctx) -> None:
    """On a rank: make one layer read a value on the host and build a tensor from numpy (the negative control)."""
    layer = ctx.state["runner"].model.model.layers[-1]

    def bad(module, args):
        args[0].sum().item()
        torch.from_numpy(np.zeros(2))

    _GUARD["bad_hook"] = layer.register_forward_pre_hook(bad)


def remove_injection(ctx) -> None:
    hook = _GUARD.pop("bad_hook", None)
    if hook is not None:
        hook.remove()
