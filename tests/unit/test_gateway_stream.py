"""The gateway's Triton side without a server: which OpenAI field a model's refusal is about, and
what a speech model's config tells the gateway (the Orpheus repository's 24 kHz clock included)."""

from __future__ import annotations

import pytest

from tandem.gateway.errors import ClientCode, ClientError, classify
from tandem.gateway.stream import SpeechModel, openai_param


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ("in ensemble 'tts', [INVALID_ARG] VOICE 'alloy' is not one of this model's voices: tara", "voice"),
        ("[INVALID_ARG] VOICE is not valid UTF-8 (byte 0)", "voice"),
        ("[INVALID_ARG] VOICE_ID is 300 bytes; the limit is 256", "voice"),
        ("[INVALID_ARG] TEXT makes 4097 prompt rows; the limit is 4096", "input"),
        ("[INVALID_ARG] TEXT is blank (only whitespace)", "input"),
        ("[INVALID_ARG] MAX_TOKENS = 0 is outside [1, 2048]", None),  # no field of the body
        ("[INVALID_ARG] a request carries exactly one of PROMPT and TEXT; it has neither", None),
    ],
)
def test_a_models_refusal_names_the_openai_field(message, param):
    assert openai_param(classify(message)) == param


def test_the_param_reads_the_detail_not_the_code():
    assert openai_param(ClientError(ClientCode.INVALID_ARG, "TEXT makes no token")) == "input"
    assert openai_param(ClientError(ClientCode.INTERNAL, "TEXT makes no token")) is None


def _config(sample_rate: str, inputs: list[str]) -> dict[str, object]:
    return {
        "name": "tts",
        "input": [{"name": n} for n in inputs],
        "output": [{"name": "AUDIO"}, {"name": "TOKENS"}],
        "parameters": {"sample_rate": {"string_value": sample_rate}, "row_width": {"string_value": "1"}},
    }


def test_an_orpheus_model_publishes_its_codecs_clock_and_takes_text():
    m = SpeechModel.from_config(_config("24000", ["PROMPT", "TEXT", "VOICE", "VOICE_ID"]))
    assert (m.sample_rate, m.row_width, m.takes_text) == (24000, 1, True)


def test_a_model_without_audio_or_a_clock_is_not_served():
    with pytest.raises(ValueError, match="not a tandem speech model"):
        SpeechModel.from_config({"name": "x", "output": [{"name": "AUDIO"}]})


def test_an_ensembles_path_is_itself_and_its_steps_models():
    """What a silent stream's dead-stub check looks at (gateway `lost_check`)."""
    steps = [{"model_name": n} for n in ("frontend", "prefill", "decode", "vocoder")]
    ensemble = {**_config("24000", ["TEXT"]), "ensemble_scheduling": {"step": steps}}
    assert SpeechModel.from_config(ensemble).path == {"tts", "frontend", "prefill", "decode", "vocoder"}
    mono = {**_config("24000", ["TEXT"]), "name": "tts_mono"}
    assert SpeechModel.from_config(mono).path == {"tts_mono"}
