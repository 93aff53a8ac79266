"""`ultrascale notebook generate | import | prompt` end to end.

The LLM is a local OpenAI-compatible HTTP server started here (real HTTP through the
openai SDK, canned answers), and every notebook the command accepts has really been
executed by a Jupyter kernel. The command runs through `ultrascale.cli.main` in this
process (starting an interpreter and importing the openai SDK costs seconds per call);
the paths where what the user sees is the point (one line, exit 2) run it as a
subprocess.
"""

import copy
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ultrascale.cli import main
from ultrascale.series.build import build_notebook, notebook_text
from ultrascale.series.episode import Episode
from ultrascale.series.lint import lint_file

DATA = os.path.join(os.path.dirname(__file__), "data")
TRANSCRIPT = ("Okay, so welcome back to the ultras scale playback series. Today: why data parallelism averages "
              "the gradients after the all reduce, as in pictoron.")


def tiny():
    with open(os.path.join(DATA, "tiny_episode.json")) as f:
        return json.load(f)


def completion(content):
    return {"id": "chatcmpl-test", "object": "chat.completion", "created": 0, "model": "fake",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1234, "completion_tokens": 567, "total_tokens": 1801}}


class FakeLLM(BaseHTTPRequestHandler):
    """POST /v1/chat/completions answers with the server's script, one entry per request."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)
        answer = self.server.script.pop(0) if self.server.script else (500, {"error": "script exhausted"}, {})
        if callable(answer):
            answer = answer(body)
        status, payload, headers = answer
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeLLM)
    srv.script, srv.requests = [], []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
    yield srv
    srv.shutdown()


@pytest.fixture
def llm(server):
    server.script.clear()
    server.requests.clear()
    return server


def ok(content):
    return 200, completion(content), {}


def ultrascale(*args, cwd, key="test-key", stdin=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    env.update(OMP_NUM_THREADS="1", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    if key is not None:
        env["OPENAI_API_KEY"] = key
    return subprocess.run([sys.executable, "-m", "ultrascale", *args], capture_output=True, text=True, cwd=str(cwd),
                          env=env, timeout=240, input=stdin)


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def work(tmp_path, monkeypatch):
    (tmp_path / "transcript.txt").write_text(TRANSCRIPT)
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)
    for k in [k for k in os.environ if k.startswith("OPENAI_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("OPENAI_API_KEY", "test-key")
    return tmp_path


@pytest.fixture
def cli(work, capsys, monkeypatch):
    """`ultrascale ARGS` in this process, in the work directory: (exit status, stdout, stderr)."""

    def run(*args, stdin=None):
        if stdin is not None:
            monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse
            code = e.code
        out = capsys.readouterr()
        return Result(code, out.out, out.err)

    return run


def generate(llm, cli, *extra, episode="6"):
    return cli("notebook", "generate", "--episode", episode, "--transcript", "transcript.txt",
               "--base-url", llm.url, "--model", "fake-model", "--out", "out", "--retry-wait", "0.05", *extra)


def files(directory):
    return sorted(os.listdir(directory))


# -- the paths through the loop ---------------------------------------------------
def test_valid_episode_is_written_and_the_request_is_what_it_should_be(llm, work):
    llm.script += [ok(json.dumps(tiny()))]
    r = ultrascale("notebook", "generate", "--episode", "6", "--transcript", "transcript.txt", "--base-url", llm.url,
                   "--model", "fake-model", "--out", "out", cwd=work)
    assert r.returncode == 0, r.stdout + r.stderr
    assert files(work / "out") == ["6_averages.ipynb"]
    assert r.stdout.strip() == "wrote out/6_averages.ipynb"
    assert "call 1:" in r.stderr and "1,234 prompt + 567 completion tokens" in r.stderr
    assert "1 call(s)" in r.stderr and "1,234 prompt + 567 completion tokens in all" in r.stderr
    assert lint_file(str(work / "out" / "6_averages.ipynb")) == []
    nb = json.loads((work / "out" / "6_averages.ipynb").read_text())
    assert "".join(nb["cells"][-1]["source"]).startswith("## Answers\n")  # the quiz's answers come last
    (request,) = llm.requests
    assert request["model"] == "fake-model"
    assert request["response_format"]["type"] == "json_schema"  # structured output first
    assert request["response_format"]["json_schema"]["schema"]["properties"]["exercises"]["maxItems"] == 2
    prompt = request["messages"][-1]["content"]
    assert "the Ultra-Scale Playbook series" in prompt and "as in Picotron" in prompt  # the glossary ran
    assert "ultras scale playback" not in prompt


def test_broken_then_good_writes_exactly_one_notebook_that_passes_check_and_run(llm, work, cli):
    llm.script += [ok("Sure! Here is the notebook you asked for: {\"number\": 6, \"title\": "), ok(json.dumps(tiny()))]
    r = generate(llm, cli)
    assert r.returncode == 0, r.stdout + r.stderr
    assert files(work / "out") == ["6_averages.ipynb"]
    assert "attempt 1 rejected" in r.stderr and "not valid JSON" in r.stderr
    # The second request sent the broken answer back with what was wrong with it.
    assert len(llm.requests) == 2
    assert llm.requests[1]["messages"][-2]["role"] == "assistant"
    assert "not valid JSON" in llm.requests[1]["messages"][-1]["content"]
    check = cli("notebook", "check", "out/6_averages.ipynb")
    assert check.returncode == 0, check.stdout
    run = cli("notebook", "run", "out/6_averages.ipynb")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "exercise 1: the check fails on the starter" in run.stdout
    assert run.stdout.strip().endswith("s") and ": ok," in run.stdout


def test_three_exercises_are_rejected_with_the_reasons(llm, work, cli):
    three = tiny()
    three["exercises"].append(copy.deepcopy(three["exercises"][0]))
    llm.script += [ok(json.dumps(three))]
    r = generate(llm, cli, "--max-repairs", "0")
    assert r.returncode == 1, r.stdout + r.stderr
    assert files(work / "out") == ["6_averages.rejected.ipynb"]
    assert "rejected after 1 attempt(s)" in r.stdout and len(llm.requests) == 1
    rejected = json.loads((work / "out" / "6_averages.rejected.ipynb").read_text())
    reasons = rejected["metadata"]["ultrascale"]["rejected"]
    assert any("exercises: found 3 exercise(s)" in reason for reason in reasons)
    assert "found 3 exercise(s)" in "".join(rejected["cells"][0]["source"])


def test_code_that_raises_is_sent_back_and_the_fix_is_kept(llm, work, cli):
    raising = tiny()
    raising["sections"][0]["cells"][1]["source"] += "\nprint(values[4] / 0)"
    llm.script += [ok(json.dumps(raising)), ok(json.dumps(tiny()))]
    r = generate(llm, cli)
    assert r.returncode == 0, r.stdout + r.stderr
    assert files(work / "out") == ["6_averages.ipynb"]
    repair = llm.requests[1]["messages"][-1]["content"]
    assert "(section 1) failed when run: IndexError: list index out of range" in repair


def test_a_bad_notebook_never_replaces_a_good_one(llm, work, cli):
    good = work / "out" / "6_averages.ipynb"
    good.write_text(notebook_text(build_notebook(Episode.from_dict(tiny()))))
    before = good.read_bytes()
    # Without --force the existing episode is refused before anything is asked.
    r = generate(llm, cli)
    assert r.returncode == 2 and "pass --force" in r.stderr and llm.requests == []
    wrong_check = tiny()
    wrong_check["exercises"][1]["check"] = "assert scale([1.0], 2) == [3.0], 'scale([1], 2) should be [3]'"
    llm.script += [ok(json.dumps(wrong_check))]
    r = generate(llm, cli, "--force", "--max-repairs", "0")
    assert r.returncode == 1, r.stdout + r.stderr
    assert good.read_bytes() == before
    assert files(work / "out") == ["6_averages.ipynb", "6_averages.rejected.ipynb"]
    assert "exercise 2: the reference solution fails its own check" in r.stderr


def test_a_check_that_passes_on_the_starter_is_rejected(llm, work, cli):
    lax = tiny()
    lax["exercises"][0]["check"] = "assert callable(average), 'define average'"
    llm.script += [ok(json.dumps(lax))]
    r = generate(llm, cli, "--max-repairs", "0")
    assert r.returncode == 1
    assert "exercise 1: the check passes on the starter code" in r.stderr


def test_rate_limit_then_success(llm, work, cli):
    llm.script += [(429, {"error": {"message": "slow down", "type": "rate_limit"}}, {"Retry-After": "0.1"}),
                   ok(json.dumps(tiny()))]
    r = generate(llm, cli)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(llm.requests) == 2
    assert "call 1:" in r.stderr and ", 1 retry" in r.stderr
    assert files(work / "out") == ["6_averages.ipynb"]


def test_no_structured_output_falls_back_to_json_in_text(llm, work, cli):
    def refuse_schemas(body):
        if "response_format" in body:
            return 400, {"error": {"message": "response_format is not supported"}}, {}
        return ok("Here it is:\n\n```json\n" + json.dumps(tiny(), indent=1) + "\n```\nEnjoy!")

    llm.script += [refuse_schemas, refuse_schemas]
    r = generate(llm, cli)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ["response_format" in q for q in llm.requests] == [True, False]
    assert "JSON read from text" in r.stderr


def test_endpoint_down_exits_within_the_retry_budget_and_writes_nothing(work):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    r = ultrascale("notebook", "generate", "--episode", "6", "--transcript", "transcript.txt", "--base-url",
                   f"http://127.0.0.1:{port}/v1", "--out", "out", "--retries", "2", "--retry-wait", "0.2", cwd=work)
    elapsed = time.monotonic() - start
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("ultrascale: error: ")
    assert "cannot connect" in r.stderr and "after 2 retries" in r.stderr
    assert r.stdout == ""
    assert files(work / "out") == []
    assert elapsed < 60  # 0.2 + 0.4 s of backoff, three refused connections, and the interpreter's start


# -- bad input: one line, exit 2, nothing written, nothing asked -------------------------------
@pytest.mark.parametrize("args, key, message", [
    (["--episode", "0"], "k", "--episode must be a positive integer"),
    (["--episode", "-3"], "k", "--episode must be a positive integer"),
    (["--episode", "four"], "k", "--episode must be a positive integer"),
    (["--transcript", "empty.txt"], "k", "is empty"),
    (["--transcript", "missing.txt"], "k", "no such file"),
    (["--transcript", "."], "k", "is a directory"),
    ([], None, "no API key"),
    ([], "", "no API key"),
    (["--out", "transcript.txt/notebooks"], "k", "is not writable"),
])
def test_bad_input(llm, work, cli, monkeypatch, args, key, message):
    (work / "empty.txt").write_text("  \n")
    base = {"--episode": "6", "--transcript": "transcript.txt", "--out": "out"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    argv = [x for kv in base.items() for x in kv]
    if key is None:
        monkeypatch.delenv("OPENAI_API_KEY")
    else:
        monkeypatch.setenv("OPENAI_API_KEY", key)
    before = files(work)
    r = cli("notebook", "generate", *argv, "--base-url", llm.url)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    assert files(work) == before and files(work / "out") == []
    assert llm.requests == []


# -- prompt and import: the chat-window path -----------------------------------------------
def test_prompt_prints_what_a_chat_window_needs(work, cli):
    (work / "out" / "6_averages.ipynb").write_text("")  # not a notebook: skipped with a note
    r = cli("notebook", "prompt", "--episode", "7", "--transcript", "transcript.txt", "--previous", "out")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("# Ultra-Scale Playbook notebook generation: Part 7")
    assert "the Ultra-Scale Playbook series" in r.stdout and '"exercises"' in r.stdout


def test_import_a_fenced_answer_and_a_notebook(work, cli):
    pasted = work / "answer.md"
    pasted.write_text("Here you go!\n\n```json\n" + json.dumps(tiny()) + "\n```\n")
    r = cli("notebook", "import", "answer.md", "--out", "out")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "wrote out/6_averages.ipynb"
    # A notebook pasted back (e.g. edited in Jupyter) goes through the same gate, under its number; one
    # that answers each question under it comes out with the answers together at the end.
    chat = json.loads((work / "out" / "6_averages.ipynb").read_text())
    answers = re.findall(r"^\*\*Question \d: (.*)$", "".join(chat["cells"].pop()["source"]), flags=re.M)
    questions = [c for c in chat["cells"] if c["metadata"]["ultrascale"].get("role") == "question"]
    for c, answer in zip(questions, answers):
        c["source"] = "".join(c["source"]) + f"\n\n<details>\n<summary>Answer</summary>\n\n**{answer}\n</details>"
    (work / "chat.ipynb").write_text(json.dumps(chat))
    r = cli("notebook", "import", "chat.ipynb", "--episode", "8", "--out", "out")
    assert r.returncode == 0, r.stdout + r.stderr
    assert files(work / "out") == ["6_averages.ipynb", "8_averages.ipynb"]
    nb = json.loads((work / "out" / "8_averages.ipynb").read_text())
    assert "".join(nb["cells"][0]["source"]).startswith("# Ultra-Scale Playbook: Part 8 - Averages")
    assert re.findall(r"^\*\*Question \d: (.*)$", "".join(nb["cells"][-1]["source"]), flags=re.M) == answers
    assert not any("<details>" in "".join(c["source"]) for c in nb["cells"][-5:])


def test_import_refuses_what_breaks_the_format(work, cli):
    five = tiny()
    five["quiz"] += copy.deepcopy(five["quiz"][:2])
    r = cli("notebook", "import", "-", "--out", "out", stdin=json.dumps(five))
    assert r.returncode == 1
    assert "quiz: the quiz has 5 question(s); ask 3 or 4" in r.stdout
    assert files(work / "out") == ["6_averages.rejected.ipynb"]
    r = cli("notebook", "import", "-", "--out", "out", stdin="   ")
    assert r.returncode == 2 and r.stderr.count("\n") == 1


def test_youtube_sources_from_the_command_line(work, cli):
    playlist = {"entries": [{"id": "aaaaaaaaa10", "title": "Ultra-Scale Playbook Part 10", "transcript": "ten"},
                            {"id": "aaaaaaaaaa1", "title": "ZeRO-1", "transcript": "zero one"},
                            {"id": "aaaaaaaaaa2", "title": "Ultra-Scale Playbook Part 1",
                             "transcript": [{"text": "the first pictoron episode"}]}]}
    (work / "playlist.json").write_text(json.dumps(playlist))
    r = cli("notebook", "prompt", "--episode", "1", "--youtube", "playlist.json")
    assert r.returncode == 0, r.stderr
    assert "```\nthe first Picotron episode\n```" in r.stdout
    r = cli("notebook", "generate", "--episode", "6", "--youtube", "not a video", "--out", "out")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not a YouTube video URL" in r.stderr
    assert files(work / "out") == []


def test_json_is_found_in_what_models_write():
    from ultrascale.series.episode import EpisodeError
    from ultrascale.series.llm import extract_json

    assert extract_json('{"a": 1, "b": 2}') == {"a": 1, "b": 2}
    assert extract_json('Sure.\n```json\n{"a": 1, "b": [2]}\n```\nAnything else?') == {"a": 1, "b": [2]}
    assert extract_json('The episode is {"a": {"x": 1}, "b": 2} - enjoy') == {"a": {"x": 1}, "b": 2}
    for text in ("", "no json here", '{"a": 1,'):
        with pytest.raises(EpisodeError):
            extract_json(text)


DDP_SETUP = '''import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

if not dist.is_initialized():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.ones(8, 1)'''

DDP_CHECK = '''torch.manual_seed(0)
single = nn.Linear(4, 1)
nn.functional.mse_loss(single(x), y).backward()
got = ddp_grads(x, y)
for g, p in zip(got, single.parameters()):
    ratio = (g.norm() / p.grad.norm()).item()
    assert torch.allclose(g, p.grad, atol=1e-6), f"DDP gradients are {ratio:.2f}x one model's: average, do not sum"'''


def ddp_episode(solution_body):
    ep = tiny()
    ep["sections"][0]["cells"].append({"kind": "code", "source": DDP_SETUP})
    ep["exercises"][0] = {
        "title": "DDP gradients",
        "instructions": "Write `ddp_grads(x, y)`: the gradients of a DDP-wrapped `nn.Linear(4, 1)` (seed 0).",
        "starter": "def ddp_grads(x, y):\n    # TODO: wrap the model in DDP, run forward and backward\n"
                   "    raise NotImplementedError",
        "solution": "def ddp_grads(x, y):\n    torch.manual_seed(0)\n    model = DDP(nn.Linear(4, 1))\n"
                    + solution_body
                    + "    nn.functional.mse_loss(model(x), y).backward()\n"
                      "    return [p.grad.clone() for p in model.parameters()]",
        "check": DDP_CHECK,
    }
    return ep


def test_a_sum_hook_on_top_of_ddp_is_caught_on_two_ranks(work, cli):
    # The seed's error: an all-reduce (SUM) hook on every parameter, on top of DDP, which already
    # averages. On a group of one the sum is the value itself, so the first run passes; as 2 ranks the
    # gradients come out 2x, and the notebook's own check says so.
    hooked = ddp_episode("    for p in model.parameters():\n"
                         "        p.register_hook(lambda g: (dist.all_reduce(g), g)[1])\n")
    r = cli("notebook", "import", "-", "--out", "out", stdin=json.dumps(hooked))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "exercise 1: the reference solution fails its check on 2 ranks" in r.stdout, r.stdout
    assert "DDP gradients are 2.00x one model's: average, do not sum" in r.stdout, r.stdout
    assert "fails its own check" not in r.stdout  # on one process it passed: only the 2-rank run sees it
    plain = ddp_episode("")
    r = cli("notebook", "import", "-", "--out", "out", "--force", stdin=json.dumps(plain))
    assert r.returncode == 0, r.stdout + r.stderr
    assert files(work / "out") == ["6_averages.ipynb"]


def test_saved_notebooks_are_readable_by_others_and_reasons_count_cells_as_saved(work, cli):
    r = cli("notebook", "import", "-", "--out", "out", stdin=json.dumps(tiny()))
    assert r.returncode == 0
    mask = os.umask(0)
    os.umask(mask)
    assert os.stat(work / "out" / "6_averages.ipynb").st_mode & 0o777 == 0o666 & ~mask
    bad = tiny()
    bad["sections"][0]["cells"][1]["source"] += "\nprint(values[4])"
    r = cli("notebook", "import", "-", "--out", "out", "--episode", "7", stdin=json.dumps(bad))
    assert r.returncode == 1
    saved = json.loads((work / "out" / "7_averages.rejected.ipynb").read_text())
    cell = next(i for i, c in enumerate(saved["cells"]) if "print(values[4])" in "".join(c["source"]))
    assert f"cell {cell} (section 1) failed when run: IndexError" in r.stdout, r.stdout
    assert f"cell {cell} (section 1) failed when run" in "".join(saved["cells"][0]["source"])
