"""vocoder: thin Triton adapter over tandem.backend.vocoder (stateless: audio depends on rows + FIRST_ROW)."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from tandem.backend.timing import now_ns
from tandem.backend.vocoder import ReferenceVocoder
from tandem.serving import triton_io as io


class TritonPythonModel:
    def initialize(self, args):
        io.setup_logging(args["model_name"])
        self.settings, _ = io.load_settings(args)
        self.vocoder = ReferenceVocoder(self.settings.vocoder)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                rows = pb_utils.get_input_tensor_by_name(request, "TOKENS").as_numpy()
                first_row = int(pb_utils.get_input_tensor_by_name(request, "FIRST_ROW").as_numpy()[0])
                timings = pb_utils.get_input_tensor_by_name(request, "TIMINGS").as_numpy()[0]
                audio = self.vocoder.synthesize(rows, first_row).astype(np.float32)
                text = timings.decode() if isinstance(timings, bytes) else str(timings)
                if first_row == 0:  # stamp the stream's first audio; decode sends timings only at the end
                    stamps = json.loads(text) if text else {}
                    stamps.setdefault("first_audio", now_ns())
                    text = json.dumps(stamps, separators=(",", ":"))
                responses.append(
                    pb_utils.InferenceResponse(
                        [
                            pb_utils.Tensor("TOKENS_OUT", rows),
                            pb_utils.Tensor("AUDIO", audio),
                            io.bytes_tensor(pb_utils, "TIMINGS_OUT", text),
                        ]
                    )
                )
            except Exception as err:
                responses.append(pb_utils.InferenceResponse(error=io.triton_error(pb_utils, err)))
        return responses
