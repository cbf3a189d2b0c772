"""Tensor parallelism for the hybrid state-space families (Bamba, GraniteMoeHybrid,
Nemotron-H): a rank's share of each Mamba-2 layer and of GraniteMoeHybrid's MLPs, split as
vLLM's MambaMixer2 does.

    in_proj  [gate I | x I | B G*S | C G*S | dt Hm, H]   column-parallel, part by part: the
             rank's heads of gate, x and dt; its groups of B and C (every rank reads the one
             group when ``mamba_n_groups`` is 1)
    conv1d   [x | B | C, 1, K] and its bias              as in_proj's x, B and C rows
    dt_bias, A_log, D [Hm]                               the rank's heads
    norm     [I]                                         the rank's heads' channels
    out_proj [H, I]                                      row-parallel (all-reduced; a bias on
                                                         rank 0 alone)
    GraniteMoeHybrid's shared_mlp / block_sparse_moe     input_linear ([2S, H], [E, 2I, H]):
                                                         the rank's rows of gate and of up;
                                                         output_linear: its columns

A rank's heads use only its groups (head h reads group h // (Hm / G)), so the scan splits
exactly. The gated RMSNorm normalises each group of I / G channels: a rank holds whole groups
when G splits; with one group, that group spans the ranks and its mean square is all-reduced.
Torch-free at import: the frontend checks the sizes (``hybrid_problems``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

HYBRID_ARCHITECTURES = ("BambaForCausalLM", "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM")
# A Mamba-2 layer's module: Bamba's and Granite's ``mamba``; Nemotron-H's ``mixer``, which also
# names its attention and MLP layers (their q/k/v/o, up/down projections split as Llama's).
_MIXERS = ("mamba", "mixer")


@dataclass(frozen=True)
class MambaShapes:
    """One rank's share of a Mamba-2 layer."""

    heads: int  # this rank's
    head_start: int
    head_dim: int
    groups: int  # this rank's groups of B and C
    group_start: int
    state: int  # d_state
    whole_heads: int
    whole_groups: int

    @classmethod
    def of(cls, hf: dict[str, Any], rank: int = 0, size: int = 1) -> MambaShapes:
        heads, groups = int(hf["mamba_n_heads"]), int(hf["mamba_n_groups"])
        per_rank_groups = groups // size if groups % size == 0 else groups  # else: one, shared
        return cls(
            heads // size,
            rank * (heads // size),
            int(hf["mamba_d_head"]),
            per_rank_groups,
            rank * per_rank_groups if per_rank_groups != groups else 0,
            int(hf["mamba_d_state"]),
            heads,
            groups,
        )

    @property
    def inner(self) -> int:  # this rank's x (and gate) channels
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:  # this rank's x, B, C channels
        return self.inner + 2 * self.groups * self.state

    @property
    def norm_spans_ranks(self) -> bool:
        """Whether the norm's one group spans the ranks (its mean square is all-reduced)."""
        return self.heads < self.whole_heads and self.groups == self.whole_groups

    def conv_rows(self) -> list[tuple[int, int]]:
        """(start, length) of the rank's x, B and C rows in the whole x | B | C channels."""
        inner, width = self.whole_heads * self.head_dim, self.whole_groups * self.state
        b = inner + self.group_start * self.state
        group_rows = self.groups * self.state
        return [
            (self.head_start * self.head_dim, self.inner),
            (b, group_rows),
            (b + width, group_rows),
        ]

    def in_proj_rows(self) -> list[tuple[int, int]]:
        """(start, length) of the rank's gate, x, B, C and dt rows in the whole in_proj."""
        inner = self.whole_heads * self.head_dim
        xbc = [(inner + start, length) for start, length in self.conv_rows()]
        dt = inner + inner + 2 * self.whole_groups * self.state + self.head_start
        return [(self.head_start * self.head_dim, self.inner), *xbc, (dt, self.heads)]


def hybrid_problems(hf: dict[str, Any], size: int) -> list[str]:
    """The sizes of a hybrid model that ``size`` ranks cannot split exactly."""
    heads, groups = int(hf["mamba_n_heads"]), int(hf["mamba_n_groups"])
    problems = [f"mamba_n_heads={heads}"] if heads % size else []
    if groups % size and groups != 1:
        problems.append(f"mamba_n_groups={groups} (nor is it 1)")
    shared = int(hf.get("shared_intermediate_size") or 0)
    if shared % size:
        problems.append(f"shared_intermediate_size={shared}")
    return problems


def read_hybrid_shard(
    hf: dict[str, Any], rank: int, size: int, name: str, source: Any
) -> torch.Tensor | None:
    """This rank's part of a Mamba-2 or Granite MLP tensor ``name`` (None: not one of them,
    split as other families' are)."""

    module, _, kind = name.rpartition(".")
    owner, _, proj = module.rpartition(".")
    if proj in _MIXERS and kind in ("dt_bias", "A_log", "D"):  # [Hm]
        shapes = MambaShapes.of(hf, rank, size)
        return source[shapes.head_start : shapes.head_start + shapes.heads]
    if owner.rpartition(".")[2] in _MIXERS:
        return _mamba_projection(MambaShapes.of(hf, rank, size), proj, kind, source, rank)
    if proj in ("input_linear", "output_linear"):
        return _granite_mlp(hf, rank, size, owner.endswith(".shared_mlp"), proj, source)
    return None


def _granite_mlp(
    hf: dict[str, Any], rank: int, size: int, shared: bool, proj: str, source: Any
) -> torch.Tensor:
    """The shared MLP's ([2S, H], [H, S]) or the experts' ([E, 2I, H], [E, H, I]) share."""
    import torch

    inter = int(hf["shared_intermediate_size" if shared else "intermediate_size"])
    per = inter // size
    start = rank * per
    if proj == "output_linear":  # the rank's columns
        return source[:, start : start + per] if shared else source[:, :, start : start + per]
    rows = [(start, per), (inter + start, per)]  # of gate, then of up
    parts = [source[s : s + n] if shared else source[:, s : s + n] for s, n in rows]
    return torch.cat(parts, 0 if shared else 1)


def _mamba_projection(
    shapes: MambaShapes, proj: str, kind: str, source: Any, rank: int
) -> torch.Tensor | None:
    import torch

    if proj in ("in_proj", "conv1d"):
        rows = shapes.in_proj_rows() if proj == "in_proj" else shapes.conv_rows()
        return torch.cat([source[start : start + length] for start, length in rows])
    if proj == "norm":
        start = shapes.head_start * shapes.head_dim
        return source[start : start + shapes.inner]
    if proj == "out_proj":
        start = shapes.head_start * shapes.head_dim
        if kind == "weight":
            return source[:, start : start + shapes.inner]
        bias = source[:] if not isinstance(source, torch.Tensor) else source
        return bias if rank == 0 else torch.zeros_like(bias)  # summed once by the all-reduce
    return None
