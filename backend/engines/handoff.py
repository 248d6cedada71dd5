"""What P hands D through the `tts` ensemble: the transfer ticket plus the stream's state.

P samples the first row and fixes the sampling seed; D continues from there. Travels as the `HANDOFF` BYTES
tensor (JSON), decode's only input; `ticket` is None when the stream ended at its first row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from tandem.backend.errors import InvalidInput
from tandem.backend.generation.sampling import SamplingParams
from tandem.backend.model.config import ModelConfig
from tandem.transfer import Ticket


@dataclass(frozen=True)
class Handoff:
    ticket: Ticket | None
    prompt_len: int
    first_row: tuple[int, ...]
    sampling: SamplingParams
    max_new_rows: int
    timings: dict[str, int]

    def to_json(self) -> str:
        return json.dumps(
            {
                "ticket": None if self.ticket is None else json.loads(self.ticket.to_json()),
                "prompt_len": self.prompt_len,
                "first_row": list(self.first_row),
                "sampling": self.sampling.to_wire(),
                "max_new_rows": self.max_new_rows,
                "timings": self.timings,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Handoff:
        """Raises ValueError on anything malformed (D turns it into a stream error)."""
        try:
            d = json.loads(text)
            ticket = None if d["ticket"] is None else Ticket.from_json(json.dumps(d["ticket"]))
            prompt_len, max_new_rows = int(d["prompt_len"]), int(d["max_new_rows"])
            if prompt_len <= 0 or max_new_rows <= 0:
                raise ValueError(f"prompt_len {prompt_len} and max_new_rows {max_new_rows} must be positive")
            if ticket is not None and ticket.n_tokens != prompt_len:
                raise ValueError(f"ticket carries {ticket.n_tokens} tokens, prompt_len says {prompt_len}")
            return cls(
                ticket=ticket,
                prompt_len=prompt_len,
                first_row=tuple(int(x) for x in d["first_row"]),
                sampling=SamplingParams.from_wire(d["sampling"]),
                max_new_rows=max_new_rows,
                timings={str(a): int(b) for a, b in d["timings"].items()},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed handoff: {exc}") from exc

    def first_row_array(self) -> np.ndarray:
        return np.asarray(self.first_row, dtype=np.int64)

    def check_fits(self, cfg: ModelConfig, pool_tokens: int) -> None:
        """A handoff that does not fit the decoder of `cfg` is refused before it reaches D's batch
        (where it would fault every other stream): a first row of row_width ids, each in its column's
        range (`ModelConfig.column_vocab`, `min_id`). Called by the `decode` stub (an early
        INVALID_ARG) and by D's engine (whatever reaches it). Raises InvalidInput."""
        row = self.first_row
        bounds = cfg.column_vocab or (cfg.vocab_size,) * cfg.row_width
        if len(row) != cfg.row_width or not all(
            cfg.min_id <= x < hi for x, hi in zip(row, bounds, strict=True)
        ):
            raise InvalidInput(
                f"malformed handoff: first row {list(row)[:8]} is not {cfg.row_width} ids "
                f"below {cfg.vocab_size}"
                + (f" (columns' bounds {list(bounds)[:8]}, absent -1)" if cfg.column_vocab else "")
            )
        if self.prompt_len + self.max_new_rows > pool_tokens:
            raise InvalidInput("malformed handoff: prompt_len + max_new_rows exceed D's whole pool")
