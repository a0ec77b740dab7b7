"""Kimi Delta Attention and Mamba-2 as decoder layers: `KDAMixer` / `Mamba2Mixer` (`kda.py`, `mamba2.py`) with the
interface every recurrent layer of the decoder offers its `RecurrentFn` (`decoder.py`) and the engine
(`engine/recurrent.py`), the one Gated DeltaNet (`gdn.py`) has:

    layer_idx, kernel, conv_channels, state_shape (H, Dk, Dv): what the state cache is sized by; outputs [T, H, Dv]
    side_shapes, side_fp32: per side input its per-token shape and whether it is fp32 (else the compute dtype)
    project(x) -> (u, side)         side a tuple of per-token tensors (rows are picked by indexing each)
    conv(u, tail) -> (u', tail')    inputs(u', side) -> the recurrence inputs
    run(inputs, state) -> (o, state_out)      summary(inputs) -> affine.Affine(M, B [H, Dk, Dv])
    map_shape: M's shape, (H, Dk, Dk) (the delta rules: the default) or (H,) (Mamba-2's decay per head)
    output(o, side, x) -> [T, hidden]         forward(x, recurrent) -> [T, hidden]

Mamba-2's state S [H, P, N] is kept transposed here, [H, N, P], so that its outputs [T, H, P] have the state's last
dimension; its map's M is the per-head decay [H] (`map_shape`), so the runner exchanges H numbers for it.
"""
from __future__ import annotations

from torch import Tensor

from cpinfer.model.recurrent import kda, mamba2
from cpinfer.model.recurrent.affine import Affine


class MixerLayer:
    """What a mixer (`shape` its config: conv_kernel, conv_channels, state_shape) adds as a decoder layer: its
    `layer_idx`, the sizes the state cache is built from, and `forward` through the engine's recurrent callback.
    The first base of a layer class, before its mixer (whose __init__ takes the shape)."""

    def __init__(self, shape, layer_idx: int):
        super().__init__(shape)
        self.layer_idx = layer_idx

    @property
    def kernel(self) -> int:
        return self.shape.conv_kernel

    @property
    def conv_channels(self) -> int:
        return self.shape.conv_channels

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return self.shape.state_shape

    def forward(self, x: Tensor, recurrent) -> Tensor:
        """x [L, hidden] (any sequences, packed) -> [L, hidden]; `recurrent(layer_idx, self, u, side)` runs the conv
        and the recurrence per sequence from its tail and state."""
        u, side = self.project(x)
        return self.output(recurrent(self.layer_idx, self, u, side), side, x)


class KDALayer(MixerLayer, kda.KDAMixer):
    """A Kimi Linear KDA layer (`self_attn` in the checkpoint)."""

    recurrence = "kda"
    checkpoint_name = "self_attn"  # the decoder layer's name of the mixer (Kimi Linear's attention and KDA share it)
    side_fp32 = (True, True, False)  # g and beta are fp32 whatever the compute dtype (the engine ships them so)

    @property
    def side_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per-token shapes of the side inputs (g, beta, gate): what the engine ships for a short shard."""
        h, d = self.shape.num_heads, self.shape.head_dim
        return ((h, d), (h,), (h, d))

    def project(self, x: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
        """x [T, hidden] -> (u [T, 3 H Dk], (g [T, H, Dk], beta [T, H], gate [T, H, Dk]))."""
        u, side = super().project(x)
        return u, (side.g, side.beta, side.gate)

    def inputs(self, u: Tensor, side: tuple) -> kda.KDAInputs:
        return super().inputs(u, kda.KDASide(*side))

    @staticmethod
    def run(inp: kda.KDAInputs, state: Tensor | None) -> tuple[Tensor, Tensor]:
        return kda.run(inp, state)

    @staticmethod
    def summary(inp: kda.KDAInputs) -> Affine:
        return kda.summary(inp)

    def output(self, o: Tensor, side: tuple, x: Tensor) -> Tensor:
        return super().output(o, kda.KDASide(*side)).to(x.dtype)


class Mamba2Layer(MixerLayer, mamba2.Mamba2Mixer):
    """A Nemotron-H Mamba-2 layer (`mixer` in the checkpoint); its state is cached transposed, [H, N, P]."""

    recurrence = "mamba2"

    @property
    def state_shape(self) -> tuple[int, int, int]:  # transposed: [H, N, P]
        s = self.shape
        return (s.num_heads, s.state_size, s.head_dim)

    side_fp32 = (False, True)  # dt is fp32 whatever the compute dtype

    @property
    def side_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per-token shapes of the side inputs (z, dt): what the engine ships for a short shard."""
        return ((self.shape.inner,), (self.shape.num_heads,))

    def project(self, x: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x [T, hidden] -> (u [T, H P + 2 G N], (z [T, H P], dt [T, H]))."""
        u, side = super().project(x)
        return u, (side.z, side.dt)

    def inputs(self, u: Tensor, side: tuple) -> mamba2.Mamba2Inputs:
        return super().inputs(u, mamba2.Mamba2Side(*side))

    def run(self, inp: mamba2.Mamba2Inputs, state: Tensor | None) -> tuple[Tensor, Tensor]:
        """(y [T, H, P] with the D skip, state_out [H, N, P]) from state [H, N, P] (None: zeros)."""
        y, s = mamba2.run(inp, None if state is None else state.transpose(1, 2), self.shape.chunk_size)
        return y, s.transpose(1, 2).contiguous()

    @property
    def map_shape(self) -> tuple[int, ...]:
        """The shape of its maps' M: a decay per head (what the engine exchanges under CP: H numbers, not H N N)."""
        return (self.shape.num_heads,)

    @staticmethod
    def summary(inp: mamba2.Mamba2Inputs) -> Affine:
        """The run's map on the transposed state: M = decay_h [H] (a scalar per head), B [H, N, P]."""
        m, b = mamba2.summary(inp)
        return Affine(m, b.transpose(1, 2).contiguous())

    def output(self, o: Tensor, side: tuple, x: Tensor) -> Tensor:
        return super().output(o, mamba2.Mamba2Side(*side)).to(x.dtype)


__all__ = ["KDALayer", "Mamba2Layer", "MixerLayer"]
