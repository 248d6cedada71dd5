"""`tandem-repo --trial-orpheus DIR` through the real tritonserver: the trial checkpoint's tokenizer
(built with `tokenizers`) takes text, Orpheus' template and grammar make audio tokens, random SNAC
makes 24 kHz audio of them; with no tokenizer (the issue this answers) TEXT was refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.cli import make_repository
from tandem.gateway.client import TTSClient
from tests.support.server import TritonProcess

MAX_TOKENS = 28  # 4 SNAC frames of 7 tokens: the first chunk (1 + lookahead frames) and more


@pytest.fixture(scope="module")
def trial(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonProcess]:
    work = tmp_path_factory.mktemp("trial-orpheus")
    assert make_repository.main(["--out", str(work / "repo"), "--trial-orpheus", str(work / "models")]) == 0
    proc = TritonProcess(work / "server")
    proc.repo = work / "repo"
    proc.start(timeout_s=600)
    yield proc
    proc.stop()


def test_the_trial_checkpoint_has_a_tokenizer_and_orpheus_layout(tmp_path: Path) -> None:
    make_repository.main(["--out", str(tmp_path / "repo"), "--trial-orpheus", str(tmp_path / "m")])
    ckpt = tmp_path / "m" / "orpheus"
    assert (ckpt / "tokenizer.json").is_file() and (
        tmp_path / "m" / "snac_24khz" / "pytorch_model.bin"
    ).is_file()
    assert json.loads((ckpt / "config.json").read_text())["vocab_size"] == 156940
    tts = (tmp_path / "repo" / "tts" / "config.pbtxt").read_text()
    assert '"sample_rate" value { string_value: "24000" }' in tts.replace("key: ", "")


@pytest.mark.parametrize("model", ["tts", "tts_mono"])
def test_text_in_audio_out(trial: TritonProcess, model: str) -> None:
    with TTSClient(trial.url, model) as c:
        r = c.run(
            None, timeout_s=300, TEXT="Hello there, how are you?", VOICE="tara", MAX_TOKENS=MAX_TOKENS, SEED=3
        )
    assert r.error is None, r.error
    assert r.rows is not None and r.rows.shape[0] == MAX_TOKENS
    assert r.audio is not None and r.audio.size > 0 and abs(r.audio).max() > 0
