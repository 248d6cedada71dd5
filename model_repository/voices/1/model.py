"""voices: thin Triton adapter over the voice registrar (register a voice from reference audio, list,
delete). The registrar runs in a worker process of its own (`tandem-engine voices <instance> --kind
voices`, started and supervised by this stub, tandem.serving.voice_stub); this stub only checks,
forwards and relays."""

import triton_python_backend_utils as pb_utils

from tandem.serving.stub_guard import StubGuard
from tandem.serving.voice_stub import VoiceStub


class TritonPythonModel:
    def initialize(self, args):
        self.guard = StubGuard(pb_utils, args)  # heartbeat; exits with the server
        self.stub = VoiceStub(pb_utils, args)

    def execute(self, requests):
        self.stub.execute(requests)
        return None

    def finalize(self):
        self.guard.close()
        self.stub.close()
