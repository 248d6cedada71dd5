"""prefill (P: prompt forward, row 0, KV offer): thin Triton adapter.

The engine runs in a worker process of its own (`tandem-engine prefill <instance> --kind prefill`, started and
supervised by this stub, tandem.serving.engine_worker); this stub only validates, forwards and relays.
"""

import triton_python_backend_utils as pb_utils

from tandem.serving.stub_guard import StubGuard


class TritonPythonModel:
    def initialize(self, args):
        # The guard first (heartbeat, tandem_engine_up 0, exits with the server), then the heavy imports.
        self.guard = StubGuard(pb_utils, args)
        from tandem.backend.worker.channel import EngineKind
        from tandem.serving.engine_stub import EngineStub

        self.stub = EngineStub(pb_utils, args, EngineKind.PREFILL, health=self.guard.health)
        self.guard.serving(engine=True)

    def execute(self, requests):
        self.stub.execute(requests)
        return None

    def finalize(self):
        self.guard.retire()  # a stub that replaced this one may publish for the instance already
        self.stub.close()  # the watcher stays on while the worker stops
        self.guard.close()
