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


@pytest.fixture(scope="session")
def varied_lm(tiny_lm_path):
    """(model, tokenizer): a small random Llama with large initial weights on the tiny asset's tokenizer. Unlike the
    tiny asset (which writes the same token whatever the prompt), its greedy tokens depend on the prompt, so equal
    tokens mean equal computation."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_lm_path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.5, tie_word_embeddings=True,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    return LlamaForCausalLM(cfg).eval(), tok


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models are dominated by per-op overhead, which extra threads only add to (and on a shared CPU, spin-waiting
    threads make it far worse); restored afterwards so other test modules keep torch's default. A module opts in
    with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class ScriptedEndpoint:
    """An OpenAI-compatible chat endpoint on loopback for tests: `answer(body, headers) -> content` writes each reply
    (or `(status, error_body)` for an error); every request's body and headers are kept in `seen`."""

    def __init__(self, answer):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.seen: list[dict] = []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                endpoint.seen.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                out = answer(body, self.headers)
                status, payload = (out if isinstance(out, tuple) else
                                   (200, {"choices": [{"message": {"role": "assistant", "content": out}}]}))
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scripted_endpoint():
    """`scripted_endpoint(answer)` starts a `ScriptedEndpoint`; every one started is closed after the test."""
    made = []

    def start(answer):
        made.append(ScriptedEndpoint(answer))
        return made[-1]

    yield start
    for e in made:
        e.close()


def pytest_collection_finish(session):
    """What the test modules imported (torch, transformers, TRL: ~460k objects), frozen out of the garbage collector's
    scans before any test builds a model, as every entry point does (`conversations.cli_util.start_process`): the
    `gc.collect()` of `release_memory` then walks what the tests made, not the libraries, and an entry point's `main()`
    called in this process later does not freeze a fixture's model."""
    from conversations.memory import freeze_startup

    freeze_startup()
