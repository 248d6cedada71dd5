"""vocoder: thin Triton adapter over the configured codec (stateless: audio depends on the chunk's
codec window alone). Decoupled: execute enqueues, `VocoderBatcher`'s thread decodes the chunks of
many streams in one codec call and answers each request once."""

import triton_python_backend_utils as pb_utils

from tandem.serving.stub_guard import StubGuard


class TritonPythonModel:
    def initialize(self, args):
        # The guard first (heartbeat, tandem_engine_up 0, exits with the server), then the heavy imports.
        self.guard = StubGuard(pb_utils, args)
        import torch

        from tandem.backend.device import resolve_device
        from tandem.backend.engines.parts import make_codec
        from tandem.serving import triton_io as io
        from tandem.serving.chunk_render import VocoderBatcher

        io.setup_logging(args["model_name"])
        settings, _ = io.load_settings(args)
        device = resolve_device(
            settings.device, args["model_instance_kind"], int(args["model_instance_device_id"])
        )
        if settings.torch_threads > 0:  # the codec's intra-op threads, beside D's on a shared CPU
            torch.set_num_threads(settings.torch_threads)
        labels = {"model": args["model_name"], "model_instance": args["model_instance_name"]}
        self.metrics = io.TritonMetrics(pb_utils, labels, names=("tandem_first_audio_seconds",))
        self.batcher = VocoderBatcher(pb_utils, make_codec(settings, device), metrics=self.metrics)
        self.guard.serving()

    def execute(self, requests):
        self.batcher.submit(requests)
        return None

    def finalize(self):
        self.guard.retire()  # a stub that replaced this one may publish for the instance already
        self.batcher.close()  # the watcher stays on while the batcher drains
        self.guard.close()
