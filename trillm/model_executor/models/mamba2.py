"""A Mamba-2 mixer (Bamba's ``mamba`` layers) over a flattened batch, with each request's
conv and SSM state in the state cache (``trillm/attention/ssm_state.py``).

The math is transformers' torch path (its reference for the mamba_ssm / causal_conv1d
kernels): in_proj -> gate | x,B,C | dt; a depthwise causal convolution over x,B,C with silu;
the selective scan; a gated, grouped RMSNorm; out_proj. A request's chunk of several tokens
(or its first token) runs the SSD chunked scan from its state; a decode token the recurrent
update, batched over the step's decode requests; both leave the request's state in its row.

Tensor parallelism: each rank holds its heads (their x, gate, dt, conv channels and state) and
its groups of B and C (``trillm/distributed/hybrid_sharding.py``); out_proj's partial sums are
all-reduced, and so is the norm's mean square when its one group spans the ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trillm.attention.ssm_state import Chunk, SSMStateLayout, SSMStep
from trillm.config import ModelConfig
from trillm.distributed.hybrid_sharding import MambaShapes
from trillm.distributed.parallel_state import TensorParallelGroup, get_tp_group
from trillm.distributed.pipeline import get_pp_group
from trillm.model_executor.bamba_config import ATTENTION, MAMBA


def hybrid_state_layout(cfg: ModelConfig, tp_size: int = 1) -> SSMStateLayout:
    """A request's state on one of ``tp_size`` ranks (its heads and groups) of this pipeline
    stage (its layers) in a model whose ``layer_types`` (as ``bamba_config`` names them) mix
    Mamba-2 and attention layers (and Nemotron-H's MLP layers, which hold neither)."""
    hf = cfg.hf_config
    pp, kinds = get_pp_group(), hf["layer_types"]
    kinds = [kind for i, kind in enumerate(kinds) if pp.owns_layer(i)]
    shapes = MambaShapes.of(hf, 0, tp_size)  # every rank's share has these sizes
    return SSMStateLayout(
        conv=(shapes.conv_dim, int(hf["mamba_d_conv"]) - 1),
        ssm=(shapes.heads, shapes.head_dim, shapes.state),
        num_layers=kinds.count(MAMBA),
        kv_layers=kinds.count(ATTENTION),
    )


def mixer_rows(kinds: list[str]) -> list[int | None]:
    """Each layer's row among this pipeline stage's Mamba-2 layers (None for another kind of
    layer; a Mamba-2 layer of another stage, pruned before it holds memory, any row)."""
    pp = get_pp_group()
    rows: list[int | None] = []
    count = 0
    for i, kind in enumerate(kinds):
        rows.append(count if kind == MAMBA else None)
        count += kind == MAMBA and pp.owns_layer(i)
    return rows


class GatedRMSNorm(nn.Module):
    """RMSNorm over groups of ``group`` channels of ``x * silu(gate)``, in float32; with
    ``spanning`` (tensor parallelism), one group of ``group`` channels split over its ranks."""

    def __init__(
        self, size: int, group: int, eps: float, spanning: TensorParallelGroup | None = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group, self.eps, self.spanning = group, eps, spanning

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [T, I] twice
        x = x.float() * F.silu(gate.float())
        if self.spanning is None:
            groups = x.view(x.shape[0], -1, self.group)  # [T, G, I / G]
            variance = groups.pow(2).mean(-1, keepdim=True)
        else:  # this rank's channels of the one group: the ranks' squares summed
            groups = x[:, None]  # [T, 1, I / N]
            variance = self.spanning.all_reduce(groups.pow(2).sum(-1, keepdim=True)) / self.group
        groups = groups * torch.rsqrt(variance + self.eps)
        return self.weight * groups.view_as(x).to(self.weight.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.index = index  # its row in the state cache's per-layer lists
        self.tp = get_tp_group()
        shapes = MambaShapes.of(hf, self.tp.rank, self.tp.world_size)  # this rank's share
        self.num_heads, self.head_dim = shapes.heads, shapes.head_dim
        self.groups, self.state_size = shapes.groups, shapes.state
        self.chunk_size = int(hf["mamba_chunk_size"])
        self.inner = shapes.inner
        self.conv_dim = shapes.conv_dim
        bias = bool(hf["mamba_proj_bias"])
        self.in_proj = nn.Linear(
            cfg.hidden_size, self.inner + self.conv_dim + self.num_heads, bias=bias
        )
        kernel = int(hf["mamba_d_conv"])
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            kernel,
            groups=self.conv_dim,
            bias=bool(hf["mamba_conv_bias"]),
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        group = shapes.whole_heads * self.head_dim // shapes.whole_groups
        spanning = self.tp if shapes.norm_spans_ranks else None
        self.norm = GatedRMSNorm(self.inner, group, cfg.rms_norm_eps, spanning)
        self.out_proj = nn.Linear(self.inner, cfg.hidden_size, bias=bias)

    def forward(self, hidden: torch.Tensor, step: SSMStep) -> torch.Tensor:  # [T, H] -> [T, H]
        proj = self.in_proj(hidden)
        gate, xbc, dt = proj.split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        out = torch.empty(hidden.shape[0], self.inner, dtype=torch.float32, device=hidden.device)
        if step.decode_rows.numel():
            rows = step.decode_rows
            out[rows] = self._decode(xbc[rows], dt[rows], step)
        for chunk in step.chunks:
            rows_of = slice(chunk.start, chunk.end)
            out[rows_of] = self._chunk(xbc[rows_of], dt[rows_of], step, chunk)
        return self.tp.all_reduce(self.out_proj(self.norm(out, gate).to(hidden.dtype)))

    def _split(
        self, xbc: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [n, C] -> x [n, h, p], B, C [n, h, s]
        group_width = self.groups * self.state_size
        x, b, c = xbc.split([self.inner, group_width, group_width], dim=-1)
        per_group = self.num_heads // self.groups
        b = b.reshape(-1, self.groups, self.state_size).float()
        c = c.reshape(-1, self.groups, self.state_size).float()
        b = b.repeat_interleave(per_group, dim=1, output_size=self.num_heads)
        c = c.repeat_interleave(per_group, dim=1, output_size=self.num_heads)
        return x.reshape(-1, self.num_heads, self.head_dim), b, c

    def _chunk(
        self, xbc: torch.Tensor, dt: torch.Tensor, step: SSMStep, chunk: Chunk
    ) -> torch.Tensor:  # [n, C], [n, h] -> [n, I] float32
        """A request's rows from its state (zero when fresh): convolution, chunked scan."""
        conv_state = step.cache.conv[self.index][chunk.slot]  # [C, K - 1]
        ssm_state = step.cache.ssm[self.index][chunk.slot]  # [h, p, s]
        history = torch.zeros_like(conv_state) if chunk.fresh else conv_state
        window = torch.cat([history, xbc.t().to(history.dtype)], dim=1)  # [C, K - 1 + n]
        conv_state.copy_(window[:, window.shape[1] - conv_state.shape[1] :])
        xbc = self._convolve(window[None])[0].t()  # [n, C]
        x, b, c = self._split(xbc)
        initial = None if chunk.fresh else ssm_state
        y, final = ssd_chunk_scan(
            x.float(), self._dt(dt), self._a(), b, c, self.D.float(), self.chunk_size, initial
        )
        ssm_state.copy_(final)
        return y.reshape(-1, self.inner)

    def _decode(
        self, xbc: torch.Tensor, dt: torch.Tensor, step: SSMStep
    ) -> torch.Tensor:  # [R, C], [R, h] -> [R, I] float32
        """One token of each decode request: the recurrent form, batched over requests."""
        conv_cache, ssm_cache = step.cache.conv[self.index], step.cache.ssm[self.index]
        slots = step.decode_slots
        window = torch.cat([conv_cache[slots], xbc[:, :, None].to(conv_cache.dtype)], dim=2)
        conv_cache[slots] = window[:, :, 1:]  # [R, C, K - 1]
        x, b, c = self._split(self._convolve(window)[:, :, -1])
        state, y = ssd_step(ssm_cache[slots], x, self._dt(dt), self._a(), b, c, self.D)
        ssm_cache[slots] = state
        return y.reshape(-1, self.inner)

    def _convolve(self, window: torch.Tensor) -> torch.Tensor:  # [B, C, K - 1 + n] -> [B, C, n]
        weight = self.conv1d.weight
        out = F.conv1d(window.to(weight.dtype), weight, self.conv1d.bias, groups=self.conv_dim)
        return F.silu(out)

    def _dt(self, dt: torch.Tensor) -> torch.Tensor:  # [n, h]: softplus(dt + dt_bias)
        return F.softplus(dt + self.dt_bias.to(dt.dtype))

    def _a(self) -> torch.Tensor:  # [h] float32
        return -torch.exp(self.A_log.float())


def segment_sums(a: torch.Tensor) -> torch.Tensor:  # [..., L] -> [..., L, L]
    """``out[..., i, j] = a[j + 1] + ... + a[i]`` for i >= j, -inf above the diagonal: the
    log-decay from position j to i (sums of masked terms, not differences of a cumsum, which
    would lose precision)."""
    length = a.shape[-1]
    terms = a[..., :, None].expand(*a.shape, length)  # terms[..., i, j] = a[i]
    ones = torch.ones(length, length, dtype=torch.bool, device=a.device)
    sums = terms.masked_fill(~ones.tril(-1), 0).cumsum(dim=-2)
    return sums.masked_fill(~ones.tril(), -torch.inf)


def ssd_chunk_scan(
    x: torch.Tensor,  # [n, h, p] float32
    dt: torch.Tensor,  # [n, h] after softplus
    a: torch.Tensor,  # [h] float32, negative
    b: torch.Tensor,  # [n, h, s] float32
    c: torch.Tensor,  # [n, h, s] float32
    d: torch.Tensor,  # [h] float32
    chunk_size: int,
    initial: torch.Tensor | None,  # [h, p, s] the state before the first row; None: zero
) -> tuple[torch.Tensor, torch.Tensor]:  # y [n, h, p], the state after the last row [h, p, s]
    """Mamba-2's state-space-duality scan: within each chunk of ``chunk_size`` rows a masked
    attention-like product, between chunks the states carried by their total decay."""
    n = x.shape[0]
    pad = (-n) % chunk_size

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [n, ...] -> [c, L, ...], zero-padded
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return t.reshape(-1, chunk_size, *t.shape[1:])

    skip = d[:, None] * F.pad(x, (0, 0, 0, 0, 0, pad))  # [n + pad, h, p]
    x = x * dt[..., None].float()
    log_decay = chunks(a * dt.float()).permute(2, 0, 1)  # [h, c, L]
    x, b, c = chunks(x), chunks(b), chunks(c)  # [c, L, h, p|s]
    cum = log_decay.cumsum(dim=-1)  # [h, c, L]
    # 1. within a chunk: y_l = sum_{s <= l} (C_l . B_s) decay(s -> l) x_s
    scores = torch.einsum("clhn,cshn->clsh", c, b) * segment_sums(log_decay).exp().permute(
        1, 2, 3, 0
    )
    y_inner = torch.einsum("clsh,cshp->clhp", scores, x)
    # 2. each chunk's own contribution to the state at its end
    to_end = (cum[..., -1:] - cum).exp()  # [h, c, L]
    states = torch.einsum("clhn,clhp->chpn", b * to_end.permute(1, 2, 0)[..., None], x)
    # 3. the state entering each chunk: the earlier chunks' states, decayed across chunks
    start = torch.zeros_like(states[:1]) if initial is None else initial[None].to(states)
    states = torch.cat([start, states])  # [c + 1, h, p, s]
    across = segment_sums(F.pad(cum[..., -1], (1, 0))).exp()  # [h, c + 1, c + 1]
    states = torch.einsum("hcz,zhpn->chpn", across, states)
    entering, final = states[:-1], states[-1]
    # 4. what each row reads of the state entering its chunk
    y_carried = torch.einsum("clhn,chpn->clhp", c, entering) * cum.exp().permute(1, 2, 0)[..., None]
    y = (y_inner + y_carried).reshape(-1, *x.shape[2:]) + skip
    return y[:n], final


def ssd_step(
    state: torch.Tensor,  # [R, h, p, s] float32
    x: torch.Tensor,  # [R, h, p]
    dt: torch.Tensor,  # [R, h] after softplus
    a: torch.Tensor,  # [h] float32
    b: torch.Tensor,  # [R, h, s] float32
    c: torch.Tensor,  # [R, h, s] float32
    d: torch.Tensor,  # [h]
) -> tuple[torch.Tensor, torch.Tensor]:  # the new state [R, h, p, s], y [R, h, p] float32
    """One token of the recurrence: ``state = exp(dt A) state + dt B x``; ``y = C state + D x``."""
    dt = dt.float()[..., None, None]  # [R, h, 1, 1]
    state = (
        state * torch.exp(dt * a[:, None, None]) + (dt * b[:, :, None, :]) * x.float()[..., None]
    )
    y = torch.einsum("rhps,rhs->rhp", state, c) + x.float() * d.float()[:, None]
    return state, y
