"""prefill (P): thin Triton adapter over tandem.backend.prefill_engine."""

import logging
import os

import triton_python_backend_utils as pb_utils

from tandem.backend.errors import TandemError
from tandem.backend.prefill_engine import PrefillEngine, PrefillRequest
from tandem.backend.timing import Timings
from tandem.serving import triton_io as io

log = logging.getLogger("tandem")


def _exit_for_proof(reason):
    """P holds ABORT_ACKs it cannot prove; at the limit its death (the free slot lock) and then its restart
    (a new instance id) are the proof (docs/failure-semantics.md). Triton 2.51 does not restart a dead
    decoupled stub: `tandem-unit` (cli/unit.py) sees the free slot lock and loads `prefill` again."""
    log.critical("prefill exits so that its restart proves no late KV write can land: %s", reason)
    os._exit(70)


class TritonPythonModel:
    def initialize(self, args):
        ctx = io.engine_context(pb_utils, args, io.Engine.PREFILL)
        self.settings, self.decoder, self.metrics = ctx.settings, ctx.decoder, ctx.metrics
        self.cfg = self.decoder.cfg
        slot = args["model_instance_name"].replace(" ", "_")
        self.engine = PrefillEngine(self.decoder, self.settings, self.metrics, slot, _exit_for_proof)
        self.engine.start()

    def execute(self, requests):
        for request in requests:
            timings = Timings()
            timings.mark("entry")
            sink = io.HandoffResponder(pb_utils, request)
            try:
                prompt, params = io.read_request(pb_utils, request, self.cfg, self.settings.limits)
                self.engine.submit(
                    PrefillRequest(
                        stream_id=io.stream_id(request),
                        prompt=prompt,
                        sampling=io.sampling_params(params),
                        max_new_rows=params.max_new_rows,
                        sink=sink,
                        timings=timings,
                    )
                )
            except TandemError as err:
                sink.fail(err)
        return None

    def finalize(self):
        self.engine.close()
