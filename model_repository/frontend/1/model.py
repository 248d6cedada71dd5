"""frontend: thin Triton adapter over tandem.backend.text.frontend (TEXT + VOICE -> rows; PROMPT as
it came)."""

import triton_python_backend_utils as pb_utils

from tandem.serving import triton_io as io
from tandem.serving.stub_guard import StubGuard


class TritonPythonModel:
    def initialize(self, args):
        self.guard = StubGuard(pb_utils, args)  # heartbeat; exits with the server
        self.frontend = io.frontend_step(args)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                rows = io.read_frontend_request(pb_utils, request, self.frontend)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("ROWS", rows)]))
            except Exception as err:
                responses.append(pb_utils.InferenceResponse(error=io.triton_error(pb_utils, err)))
        return responses

    def finalize(self):
        self.guard.close()
