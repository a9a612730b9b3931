"""Forward FLOPs of a text model over one log-prob call, attention included: plain rows against grouped rows.

A token costs its linear layers (``token_flops``: q, k, v, o projections and the gated MLP, 2 FLOPs per
multiply-add); a query-key pair costs ``pair_flops`` (``Q K^T`` and ``A V``: ``4 * heads * head_dim``). Attention
is counted over every pair the kernel computes: a masked SDPA call computes its whole ``queries x keys`` block, a
causal call without a mask skips the blocks above the diagonal (``causal_pairs``). So the plain path's ``B`` rows of
width ``L`` cost ``B L^2`` pairs where the call has padding (completions that end at different lengths: the usual
case in training) and ``B L (L + 1) / 2`` where it has none; the grouped path costs, per group of prompt ``P`` and
``n`` completions of ``R``, the cheaper of its two forms (``grouped_forms``, ``grouped_attention.py``), never more
than the plain path's unpadded count. A log-prob call also runs the vocabulary head on its needed positions
(``TextWidths.head_flops``: the same on both paths) and the vision tower on its images (``VisionWidths``: once per
row's image on the plain path, once per group's on the packed one); ``call_flops`` adds both. At true Qwen2.5-VL-3B
widths, one layer and block, G 5, R 256, the decoder alone put a call's shared / plain at 0.34, the whole call at 0.39:
the head there is four decoder layers' worth per completion token (docs/performance.md's true-width table, where the
measured call on one CPU thread, whose head product runs four times the tower's rate, took 0.29).

``dense_packed`` is the layout grouped attention replaced (one ``W x W`` mask over ``W = P + G R``), kept to show
where it lost: at Qwen2.5-VL-3B's widths, P 1100, G 8, it cost 1.15x the padded plain path at R 2048 and 1.79x at
R 4096.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextWidths:
    """The widths of a text model that set its forward FLOPs."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int = 0  # the vocabulary head's width (0: the head left out)

    @classmethod
    def of(cls, text_config) -> TextWidths:
        heads = text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
        return cls(
            hidden=text_config.hidden_size,
            intermediate=text_config.intermediate_size,
            heads=heads,
            kv_heads=getattr(text_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            layers=text_config.num_hidden_layers,
            vocab=text_config.vocab_size,
        )

    @property
    def token_flops(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return 2 * self.layers * (attention + 3 * self.hidden * self.intermediate)

    @property
    def pair_flops(self) -> int:
        return 4 * self.layers * self.heads * self.head_dim

    def flops(self, tokens: float, pairs: float) -> float:
        return tokens * self.token_flops + pairs * self.pair_flops

    def head_flops(self, positions: float) -> float:
        """The vocabulary head over ``positions`` needed positions."""
        return 2 * self.hidden * self.vocab * positions


@dataclass(frozen=True)
class VisionWidths:
    """The widths of a Qwen-VL vision tower that set one image's forward FLOPs: per block its linear layers per patch
    (fused qkv, output projection, MLP: gated with three matrices on Qwen2.5-VL, two elsewhere) and its attention
    pairs (every patch pair in a full-attention block, a window's patches in the others), then the patch merger."""

    hidden: int
    intermediate: int
    mlp_matrices: int
    depth: int
    full_blocks: tuple[int, ...]
    window_patches: int
    merge: int
    out_hidden: int

    @classmethod
    def of(cls, vision_config) -> VisionWidths:
        hidden = getattr(vision_config, "hidden_size", None) or vision_config.embed_dim
        window = getattr(vision_config, "window_size", None)
        depth = vision_config.depth
        return cls(
            hidden=hidden,
            intermediate=getattr(vision_config, "intermediate_size", 0) or hidden * vision_config.mlp_ratio,
            mlp_matrices=3 if vision_config.model_type.startswith("qwen2_5") else 2,
            depth=depth,
            full_blocks=tuple(vision_config.fullatt_block_indexes) if window else tuple(range(depth)),
            window_patches=(window // vision_config.patch_size) ** 2 if window else 0,
            merge=vision_config.spatial_merge_size**2,
            out_hidden=getattr(vision_config, "out_hidden_size", hidden),
        )

    def image_flops(self, patches: int) -> float:
        h = self.hidden
        linear = 2 * (4 * h * h + self.mlp_matrices * h * self.intermediate)
        pairs = sum(patches * (patches if i in self.full_blocks else self.window_patches) for i in range(self.depth))
        merger = 2 * (patches // self.merge) * (self.merge * h) * (self.merge * h + self.out_hidden)
        return self.depth * patches * linear + 4 * h * pairs + merger


def call_flops(widths: TextWidths, vision: VisionWidths | None, positions: float, image_grid_thw) -> float:
    """What a log-prob call computes beyond its text decoder: the head over ``positions`` needed positions and the
    tower over the images of ``image_grid_thw`` (``(n, 3)``: frames, height and width in patches; None: none)."""
    images = 0.0
    if vision is not None and image_grid_thw is not None:
        images = sum(vision.image_flops(int(patches)) for patches in image_grid_thw.prod(-1).tolist())
    return widths.head_flops(positions) + images


def causal_pairs(width: int) -> int:
    """Query-key pairs a causal call over ``width`` tokens computes (the diagonal included)."""
    return width * (width + 1) // 2


def grouped_forms(prompt: int, completion: int, n: int) -> dict[str, int]:
    """Pairs of one group's two grouped-attention forms: ``stacked`` (one causal call per completion over
    ``[prompt; completion]``) and ``split`` (the prompt causal once, then each completion masked over
    ``[prompt; own]``)."""
    return {
        "stacked": n * causal_pairs(prompt + completion),
        "split": causal_pairs(prompt) + n * completion * (prompt + completion),
    }


def plain(widths: TextWidths, rows: int, width: int, *, padded: bool = True) -> float:
    """``rows`` rows of ``width`` tokens, each its own attention block: whole where the call carries padding (a
    masked call), causal where it carries none."""
    return widths.flops(rows * width, rows * (width**2 if padded else causal_pairs(width)))


def grouped(widths: TextWidths, tokens: int, pairs: int) -> float:
    """A flat packed row of ``tokens`` whose grouped attention computes ``pairs`` query-key pairs per head."""
    return widths.flops(tokens, pairs)


def per_group(
    widths: TextWidths, prompt: int, completion: int, group: int, *, padded: bool = True
) -> dict[str, float]:
    """One group's forward FLOPs on each path (prompt ``prompt`` tokens, ``group`` completions of ``completion``;
    ``padded``: whether the plain path's call carries padding)."""
    packed = prompt + group * completion
    return {
        "plain": plain(widths, group, prompt + completion, padded=padded),
        "grouped": grouped(widths, packed, min(grouped_forms(prompt, completion, group).values())),
        "dense_packed": widths.flops(packed, packed**2),
    }
