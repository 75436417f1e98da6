import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads from a model hub, in tests least of all
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_lm_path():
    from conversations.assets import resolve_model

    return resolve_model("tiny-random")


@pytest.fixture(scope="session")
def tiny_encoder_path():
    from conversations.assets import resolve_model

    return resolve_model("tiny-random-encoder")
