"""tts_mono: thin Triton adapter over tandem.backend.mono_engine (prefill + decode on one device)."""

import triton_python_backend_utils as pb_utils

from tandem.backend.codec_builder import build_codec, codec_spec
from tandem.backend.errors import TandemError
from tandem.backend.mono_engine import MonoEngine
from tandem.backend.stream import EngineRequest
from tandem.backend.timing import Timings
from tandem.serving import chunk_render
from tandem.serving import triton_io as io


class TritonPythonModel:
    def initialize(self, args):
        ctx = io.engine_context(pb_utils, args)
        self.settings, self.decoder, self.metrics = ctx.settings, ctx.decoder, ctx.metrics
        self.cfg = self.decoder.cfg
        io.check_published(ctx.config, self.cfg, codec_spec(self.settings))
        self._render = chunk_render.MonoRender(pb_utils, build_codec(self.settings, self.decoder.device))
        self.engine = MonoEngine(self.decoder, self.settings, self.metrics)
        self.engine.start()

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
