"""frontend: thin Triton adapter over tandem.backend.text.frontend (TEXT + VOICE -> rows; PROMPT as
it came)."""

import triton_python_backend_utils as pb_utils

from tandem.serving.stub_guard import StubGuard


class TritonPythonModel:
    def initialize(self, args):
        # The guard first (heartbeat, tandem_engine_up 0, exits with the server), then the heavy imports.
        self.guard = StubGuard(pb_utils, args)
        from tandem.serving import triton_io

        self.io = triton_io
        self.frontend = triton_io.frontend_step(args)
        self.guard.serving()

    def execute(self, requests):
        io = self.io
        responses = []
        for request in requests:
            try:
                rows = io.read_frontend_request(pb_utils, request, self.frontend)
                responses.append(pb_utils.InferenceResponse(io.frontend_tensors(pb_utils, rows)))
            except Exception as err:
                responses.append(pb_utils.InferenceResponse(error=io.triton_error(pb_utils, err)))
        return responses

    def finalize(self):
        self.guard.close()
