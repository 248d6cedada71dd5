"""decode (D): thin Triton adapter over tandem.backend.decode_engine."""

import numpy as np
import triton_python_backend_utils as pb_utils

from tandem.backend.decode_engine import DecodeEngine, DecodeRequest
from tandem.backend.errors import InvalidInput, TandemError
from tandem.backend.handoff import Handoff
from tandem.backend.timing import Timings
from tandem.serving import triton_io as io


class TritonPythonModel:
    def initialize(self, args):
        ctx = io.engine_context(pb_utils, args, io.Engine.DECODE)
        self.settings, self.decoder, self.metrics = ctx.settings, ctx.decoder, ctx.metrics
        self.engine = DecodeEngine(self.decoder, self.settings, self.metrics)
        self.engine.start()

    @staticmethod
    def _render(chunk):
        return [
            pb_utils.Tensor("TOKENS", chunk.rows),
            pb_utils.Tensor("FIRST_ROW", np.array([chunk.first_row], dtype=np.int64)),
            io.bytes_tensor(pb_utils, "TIMINGS", io.timings_text(chunk) if chunk.final else ""),
        ]

    def execute(self, requests):
        for request in requests:
            sink = io.ResponseSink(pb_utils, request, self._render)
            try:
                raw = pb_utils.get_input_tensor_by_name(request, "HANDOFF").as_numpy()[0]
                try:
                    handoff = Handoff.from_json(raw)
                except ValueError as exc:
                    raise InvalidInput(str(exc)) from None
                timings = Timings(handoff.timings)
                timings.mark("d_entry")
                self.engine.submit(DecodeRequest(io.stream_id(request), handoff, sink, timings))
            except TandemError as err:
                sink.fail(err)
        return None

    def finalize(self):
        self.engine.close()
