"""tts_mono: thin Triton adapter over tandem.backend.mono_engine (prefill + decode on one device)."""

import numpy as np
import triton_python_backend_utils as pb_utils

from tandem.backend.errors import TandemError
from tandem.backend.mono_engine import MonoEngine
from tandem.backend.stream import EngineRequest
from tandem.backend.timing import Timings
from tandem.backend.vocoder import ReferenceVocoder
from tandem.serving import triton_io as io


class TritonPythonModel:
    def initialize(self, args):
        ctx = io.engine_context(pb_utils, args, io.Engine.MONO)
        self.settings, self.decoder, self.metrics = ctx.settings, ctx.decoder, ctx.metrics
        self.cfg = self.decoder.cfg
        io.check_published(ctx.config, self.cfg, self.settings.vocoder)
        self.vocoder = ReferenceVocoder(self.settings.vocoder)
        self.engine = MonoEngine(self.decoder, self.settings, self.metrics)
        self.engine.start()

    def _render(self, chunk):
        audio = self.vocoder.synthesize(chunk.rows, chunk.first_row)
        return [
            pb_utils.Tensor("TOKENS", chunk.rows),
            pb_utils.Tensor("AUDIO", audio.astype(np.float32)),
            io.bytes_tensor(pb_utils, "TIMINGS", io.timings_text(chunk) if chunk.final else ""),
        ]

    def execute(self, requests):
        for request in requests:
            timings = Timings()
            timings.mark("entry")
            sink = io.ResponseSink(pb_utils, request, self._render)
            try:
                prompt, params = io.read_request(pb_utils, request, self.cfg, self.settings.limits)
                req = EngineRequest(
                    stream_id=io.stream_id(request),
                    prompt=prompt,
                    sampling=io.sampling_params(params),
                    max_new_rows=params.max_new_rows,
                    sink=sink,
                    timings=timings,
                )
                self.engine.submit(req)
            except TandemError as err:
                sink.fail(err)
        return None

    def finalize(self):
        self.engine.close()
