"""Sesame CSM's two Llama-shaped decoders on the project's own `Decoder` (paged KV, the same kernels).

CSM speaks in Mimi frames of N codebooks (CSM-1B: N = 32, 12.5 frames a second). Per frame:
- the backbone (Llama-3.2-1B shape) reads one row per position and predicts codebook 0 of the next
  frame from its final hidden state h;
- the depth decoder (a small Llama) restarts for every frame: position 0 is h projected to its width,
  position k (1..N-1) is codebook k-1's code; the output at position k predicts codebook k with a
  head of its own (`codebooks_head[k-1]`). Its KV lives only while the frame is made and never
  crosses P -> D (docs/codecs.md, "CSM").

Rows (`CsmRows`): a backbone row is N + 1 ids, codebooks 0..N-1 then the text column (Sesame's
layout: `frame_tokens[:, :-1]` audio, `[:, -1]` text); ABSENT (-1) marks a column a row does not carry:
a text row has only its text id, an audio row (a frame) only its codes. A row embeds as the sum of
its present columns (audio column c from rows c*V..c*V+V-1 of the [N*V, H] codebook table, text from
the [T, H] text table), which is what transformers computes: a text position embeds its token, an
audio position the sum of its N codebook embeddings. A depth row is one id: codebook k's code c as
k*V + c (the depth decoder's table is the same [N*V, H_backbone] codebook table, then projected).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.backend.generation.vocab_span import VocabSpan
from tandem.backend.model.config import ModelConfig
from tandem.backend.model.decoder import Decoder

ABSENT = -1  # a column a row does not carry (CsmRows)


@dataclass(frozen=True)
class CsmRows:
    """The shape of CSM's rows: `codebooks` audio columns of `codebook_vocab` ids (Mimi's codes plus
    CSM's pad/eos ids), then one text column of `text_vocab` ids."""

    codebooks: int
    codebook_vocab: int
    text_vocab: int

    @property
    def width(self) -> int:
        return self.codebooks + 1

    @property
    def text_column(self) -> int:
        return self.codebooks


class CsmRowEmbedding(nn.Module):
    """The backbone's input tables: `audio` [N*V, H] (CSM's `embed_audio_tokens`) and `text` [T, H]
    (CSM's `embed_text_tokens`). Built on the meta device by `CsmBackbone`; filled by the loader."""

    def __init__(self, rows: CsmRows, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.audio = nn.Embedding(rows.codebooks * rows.codebook_vocab, hidden, dtype=dtype)
        self.text = nn.Embedding(rows.text_vocab, hidden, dtype=dtype)


class CsmBackbone(Decoder):
    """CSM's backbone: a Llama over rows of N + 1 ids (`CsmRows`) whose head (`lm_head`, [V, H])
    predicts codebook 0 only: logits [n, 1, V]. Everything else (prefill, paged decode, CUDA graphs)
    is `Decoder`'s."""

    def __init__(self, cfg: ModelConfig, rows: CsmRows, device: torch.device | str = "cpu") -> None:
        """`cfg`: the backbone's shape with row_width N + 1 and vocab_size V (the codebook vocabulary)."""
        if cfg.row_width != rows.width or cfg.vocab_size != rows.codebook_vocab:
            raise ValueError(
                f"a CSM backbone needs row_width {rows.width} and vocab_size {rows.codebook_vocab}"
            )
        self.rows = rows
        super().__init__(cfg, device)
        dev = self.device
        self.register_buffer(
            "_audio_offsets", torch.arange(rows.codebooks, device=dev) * rows.codebook_vocab, persistent=False
        )

    def _make_embedding(self, cfg: ModelConfig, dtype: torch.dtype) -> nn.Module:
        return CsmRowEmbedding(self.rows, cfg.hidden_size, dtype)

    def _make_head(self, cfg: ModelConfig, dtype: torch.dtype) -> nn.Linear | None:
        return nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)

    def _embed(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [N, C+1] -> [N, H]: the sum of each row's present columns (module docstring)."""
        if rows.ndim != 2 or rows.shape[1] != self.rows.width:
            raise ValueError(f"rows must be [N, {self.rows.width}], got {tuple(rows.shape)}")
        rows = rows.to(self.device, torch.long)
        table = self.model.embed_tokens
        audio, text = rows[:, : self.rows.codebooks], rows[:, self.rows.text_column]
        audio_on, text_on = audio != ABSENT, text != ABSENT
        a = table.audio(torch.where(audio_on, audio, 0) + self._audio_offsets)
        a = (a * audio_on[..., None].to(a.dtype)).sum(dim=1)
        t = table.text(torch.where(text_on, text, 0)) * text_on[:, None].to(a.dtype)
        return a + t

    @torch.inference_mode()
    def head_logits(self, h: torch.Tensor, span: VocabSpan | None = None) -> torch.Tensor:
        """Codebook 0's float32 logits [n, 1, width] of span's ids (None: all V) from hidden h [n, H]."""
        assert self.lm_head is not None
        weight = self.lm_head.weight
        if span is not None and span.vocab_size != self.cfg.vocab_size:
            raise ValueError(f"{span} is not of this model's vocabulary of {self.cfg.vocab_size} ids")
        if span is not None and not span.is_whole:
            weight = weight[span.lo : span.hi]
        return (h @ weight.to(h.dtype).T).float()[:, None, :]


class CsmDepthEmbedding(nn.Module):
    """The depth decoder's input: `table` [N*V, H_backbone] (the codebook table, shared with the
    backbone's when the checkpoint ties them) and `projector` [H_depth, H_backbone]."""

    def __init__(self, rows: CsmRows, backbone_hidden: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = nn.Embedding(rows.codebooks * rows.codebook_vocab, backbone_hidden, dtype=dtype)
        self.projector = nn.Linear(backbone_hidden, hidden, bias=False, dtype=dtype)


class CsmDepth(Decoder):
    """CSM's depth decoder: a Llama over rows of one id (codebook k's code c as k*V + c) whose
    position 0 is the backbone's hidden state (`project`, passed as `PrefillItem.embeds`); codebook
    k's logits come from `codebook_logits` (a head per codebook, so `head_logits` is refused)."""

    codebooks_head: nn.Parameter

    def __init__(
        self, cfg: ModelConfig, rows: CsmRows, backbone_hidden: int, device: torch.device | str = "cpu"
    ) -> None:
        """`cfg`: the depth decoder's shape with row_width 1 and vocab_size V."""
        if cfg.row_width != 1 or cfg.vocab_size != rows.codebook_vocab:
            raise ValueError(f"a CSM depth decoder needs row_width 1 and vocab_size {rows.codebook_vocab}")
        self.rows = rows
        self.backbone_hidden = backbone_hidden
        super().__init__(cfg, device)
        self.codebooks_head = nn.Parameter(
            torch.empty(
                rows.codebooks - 1, cfg.hidden_size, cfg.vocab_size, dtype=cfg.torch_dtype, device=device
            ),
            requires_grad=False,
        )

    def _make_embedding(self, cfg: ModelConfig, dtype: torch.dtype) -> nn.Module:
        return CsmDepthEmbedding(self.rows, self.backbone_hidden, cfg.hidden_size, dtype)

    def _make_head(self, cfg: ModelConfig, dtype: torch.dtype) -> nn.Linear | None:
        return None

    def _embed(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.ndim != 2 or rows.shape[1] != 1:
            raise ValueError(f"depth rows must be [N, 1], got {tuple(rows.shape)}")
        e = self.model.embed_tokens
        return e.projector(e.table(rows[:, 0].to(self.device, torch.long)))

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """The backbone's hidden states [n, H_backbone] as depth position-0 inputs [n, H_depth]."""
        return self.model.embed_tokens.projector(h.to(self.device, self.cfg.torch_dtype))

    def depth_rows(self, codebook: int, codes: torch.Tensor) -> torch.Tensor:
        """Codes [n] of `codebook` as depth rows [n, 1] (ids codebook*V + code)."""
        return (codes.to(torch.long) + codebook * self.rows.codebook_vocab)[:, None]

    @torch.inference_mode()
    def codebook_logits(self, h: torch.Tensor, codebook: int) -> torch.Tensor:
        """Float32 logits [n, 1, V] of `codebook` (1..N-1) from the depth's hidden states h [n, H]
        at position `codebook` (its input there was codebook - 1's code)."""
        if not 1 <= codebook < self.rows.codebooks:
            raise ValueError(
                f"the depth decoder predicts codebooks 1..{self.rows.codebooks - 1}, not {codebook}"
            )
        return (h @ self.codebooks_head[codebook - 1].to(h.dtype)).float()[:, None, :]

    def head_logits(self, h: torch.Tensor, span: VocabSpan | None = None) -> torch.Tensor:
        raise ValueError("the CSM depth decoder has a head per codebook: codebook_logits(h, codebook)")
