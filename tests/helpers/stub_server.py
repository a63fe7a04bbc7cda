"""An OpenAI-shaped HTTP stub in this process (a thread on 127.0.0.1), for the tests of data/openai_client.py
(tests/unit/test_openai_client.py) and of the tools that talk to it (tests/jobs/test_regenerate_jobs.py): `Stub`, and
the fixture `stubs` (stubs(name, models=...) -> a started Stub, all stopped after the test), imported by name."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class Stub:
    """An OpenAI-shaped server: /v1/models lists `models`; a POST answers "<prompt>@<name>" unless `status` maps
    its prompt (a chat's last content, a completion's prompt) to an HTTP status (then an OpenAI error body).
    `answer(prompt, body)`, when set, gives the text instead (or an HTTP status, an int)."""

    def __init__(self, name="s", models=({"id": "tgt", "max_model_len": 256},)):
        self.name, self.models, self.status, self.seen, self.auth = name, list(models), {}, [], []
        self.lock = threading.Lock()
        self.answer = None
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def reply(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                stub.auth.append(self.headers.get("Authorization"))
                if stub.status.get("models"):
                    return self.reply(stub.status["models"], {"error": {"message": "no models here"}})
                self.reply(200, {"object": "list", "data": stub.models})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["messages"][-1]["content"] if "messages" in body else str(body["prompt"])
                with stub.lock:
                    stub.seen.append((self.path, body))
                code = stub.status.get(prompt, 200)
                if body["model"] not in [m["id"] for m in stub.models]:
                    return self.reply(404, {"object": "error", "message": f"The model `{body['model']}` does not "
                                                                          f"exist.", "code": 404})
                text = stub.answer(prompt, body) if stub.answer else f"{prompt}@{stub.name}"
                code = text if isinstance(text, int) else code
                if code != 200:
                    return self.reply(code, {"error": {"message": f"status {code} for {prompt}"}})
                key = "message" if "messages" in body else "text"
                choice = {key: {"role": "assistant", "content": text} if key == "message" else text,
                          "finish_reason": "stop"}
                self.reply(200, {"choices": [choice] * body.get("n", 1), "usage": {"completion_tokens": 3,
                                                                                   "prompt_tokens": 5}})

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stubs():
    made = []

    def make(*a, **kw):
        made.append(Stub(*a, **kw))
        return made[-1]
    yield make
    for s in made:
        s.stop()
