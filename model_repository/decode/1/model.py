"""decode (D: KV receive, continuous batching): thin Triton adapter.

The engine runs in a worker process of its own (`tandem-engine decode <instance> --kind decode`, started and
supervised by this stub, tandem.serving.engine_worker); this stub only validates, forwards and relays.
"""

import triton_python_backend_utils as pb_utils

from tandem.backend.worker.channel import EngineKind
from tandem.serving.engine_stub import EngineStub
from tandem.serving.stub_guard import StubGuard


class TritonPythonModel:
    def initialize(self, args):
        self.guard = StubGuard(pb_utils, args)  # heartbeat; exits with the server
        self.stub = EngineStub(pb_utils, args, EngineKind.DECODE)

    def execute(self, requests):
        self.stub.execute(requests)
        return None

    def finalize(self):
        self.guard.close()
        self.stub.close()
