"""Where a transcript comes from (files, YouTube), the glossary of caption mis-hearings, and the prompt."""

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qs, urlparse

import pytest
import requests
from requests.adapters import HTTPAdapter

from ultrascale.config import ConfigError
from ultrascale.series.episode import Episode
from ultrascale.series.glossary import apply_glossary, load_glossary
from ultrascale.series.prompt import build_prompt, repair_prompt
from ultrascale.series.schema import EPISODE_SCHEMA
from ultrascale.series.transcript import (episode_entry, episode_of, fetch_youtube, read_transcript, video_id,
                                          youtube_transcript)

DATA = os.path.join(os.path.dirname(__file__), "data")

SRT = """1
00:00:00,000 --> 00:00:02,500
Okay, so welcome back to the

2
00:00:02,500 --> 00:00:05,000
ultras scale playback series.

3
00:00:05,000 --> 00:01:05,120
<i>Data parallelism</i> today.
"""

# YouTube's auto captions: every line shows up twice (rolling), with word timings.
VTT = """WEBVTT
Kind: captions
Language: en

NOTE produced by YouTube

00:00:00.000 --> 00:00:02.000 align:start position:0%
so<00:00:00.500><c> welcome</c><00:00:01.000><c> back</c>

00:00:02.000 --> 00:00:02.010 align:start position:0%
so welcome back

00:00:02.010 --> 00:00:04.000 align:start position:0%
so welcome back
to pictoron today
"""


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return str(p)


# -- files ----------------------------------------------------------------------
def test_srt_vtt_json_and_text(tmp_path):
    assert read_transcript(write(tmp_path, "a.srt", SRT)) == \
        "Okay, so welcome back to the ultras scale playback series. Data parallelism today."
    assert read_transcript(write(tmp_path, "a.vtt", VTT)) == "so welcome back to pictoron today"
    snippets = [{"text": "hello", "start": 0.0, "duration": 1.0}, {"text": "all\nreduce", "start": 1.0,
                                                                    "duration": 1.0}]
    assert read_transcript(write(tmp_path, "a.json", json.dumps(snippets))) == "hello all reduce"
    json3 = {"events": [{"tStartMs": 0, "segs": [{"utf8": "ring "}, {"utf8": "all-reduce"}]}, {"tStartMs": 1},
                        {"segs": [{"utf8": "done"}]}]}
    assert read_transcript(write(tmp_path, "b.json", json.dumps(json3))) == "ring all-reduce done"
    assert read_transcript(write(tmp_path, "a.txt", "  plain\n\n text  ")) == "plain\ntext"


@pytest.mark.parametrize("name, content, message", [
    ("empty.txt", "", "is empty"),
    ("blank.txt", " \n\t\n", "is empty"),
    ("timings.srt", "1\n00:00:00,000 --> 00:00:01,000\n\n", "is empty"),
    ("bad.json", "{ nope", "not valid JSON"),
    ("other.json", '{"title": "x"}', "not a YouTube transcript"),
    ("latin1.txt", b"caf\xe9", "not UTF-8"),
])
def test_unusable_transcript_files(tmp_path, name, content, message):
    p = tmp_path / name
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError, match=message):
        read_transcript(str(p))


def test_missing_transcript_and_directory(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        read_transcript(str(tmp_path / "nope.txt"))
    with pytest.raises(ConfigError, match="is a directory"):
        read_transcript(str(tmp_path))


# -- playlists: episode N is exactly N ----------------------------------------------
@pytest.mark.parametrize("title, n", [
    ("Ultra-Scale Playbook: Part 1 - Intro", 1), ("Part 10: pipeline parallelism", 10),
    ("Episode 4 - data parallelism", 4), ("Ep. 7 tensor parallelism", 7), ("Ultra-Scale Playbook #5", 5),
    ("4. Data parallelism", 4), ("ZeRO-1 and ZeRO-2 explained", None), ("Part 1.5 bonus", None),
    ("Step 3 of the recipe", None),
])
def test_episode_number_in_a_title(title, n):
    assert episode_of(title) == n


def test_playlist_lookup_matches_the_number_exactly(tmp_path):
    playlist = {"_type": "playlist", "entries": [
        {"id": "aaaaaaaaaa1", "title": "Ultra-Scale Playbook Part 10: pipelines", "transcript": "ten"},
        {"id": "aaaaaaaaaa2", "title": "ZeRO-1 in ten minutes", "transcript": "zero"},
        {"id": "aaaaaaaaaa3", "title": "Ultra-Scale Playbook Part 11", "transcript": "eleven"},
        {"id": "aaaaaaaaaa4", "title": "Ultra-Scale Playbook Part 1: the first steps", "transcript": "one"},
        {"id": "aaaaaaaaaa5", "title": "Part 2 (re-upload)", "transcript": [{"text": "two a"}]},
        {"id": "aaaaaaaaaa6", "title": "Part 2", "transcript": [{"text": "two b"}]},
    ]}
    path = write(tmp_path, "playlist.json", json.dumps(playlist))
    assert read_transcript(path, episode=1) == "one"
    assert read_transcript(path, episode=10) == "ten"
    assert youtube_transcript(path, episode=11) == "eleven"  # --youtube playlist.json
    with pytest.raises(ConfigError, match="no video title says episode 3"):
        read_transcript(path, episode=3)
    with pytest.raises(ConfigError, match="2 videos say episode 2"):
        read_transcript(path, episode=2)
    with pytest.raises(ConfigError, match="pass --episode"):
        episode_entry(playlist["entries"], None)


@pytest.mark.parametrize("given", [
    "dQw4w9WgXcQ", "https://www.youtube.com/watch?v=dQw4w9WgXcQ&t=42s", "youtu.be/dQw4w9WgXcQ",
    "https://www.youtube.com/shorts/dQw4w9WgXcQ", "https://www.youtube.com/embed/dQw4w9WgXcQ?x=1",
    "https://m.youtube.com/watch?list=PL123&v=dQw4w9WgXcQ",
])
def test_video_ids(given):
    assert video_id(given) == "dQw4w9WgXcQ"


def test_not_a_video():
    with pytest.raises(ConfigError, match="yt-dlp --flat-playlist -J"):
        video_id("https://www.youtube.com/playlist?list=PL1234567890")
    with pytest.raises(ConfigError, match="not a YouTube video URL"):
        video_id("https://example.com/watch?v=dQw4w9WgXcQ")
    with pytest.raises(ConfigError, match="not a YouTube video URL"):
        video_id("episode four")


# -- YouTube itself: youtube-transcript-api against a local stand-in for youtube.com ----------
class _FakeYouTube(BaseHTTPRequestHandler):
    def _send(self, status, body, kind):
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        url = urlparse(self.path)
        vid = parse_qs(url.query).get("v", [""])[0]
        if url.path == "/watch":
            self._send(200, '<html><script>ytcfg.set({"INNERTUBE_API_KEY": "fake-key"});</script></html>',
                       "text/html")
        elif url.path == "/api/timedtext":
            self._send(200, '<?xml version="1.0" encoding="utf-8" ?><transcript>'
                            '<text start="0.0" dur="1.5">welcome back to the ultras scale</text>'
                            '<text start="1.5" dur="2.0">playback &amp;amp; data parallelism</text>'
                            f'<text start="3.5" dur="1.0">({vid})</text></transcript>', "text/xml")
        else:
            self._send(404, "not found", "text/plain")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        vid = body["videoId"]
        if vid == "unavailable":
            data = {"playabilityStatus": {"status": "ERROR", "reason": "This video is unavailable"}}
        else:
            data = {"playabilityStatus": {"status": "OK"}, "captions": {"playerCaptionsTracklistRenderer": {
                "captionTracks": [{"baseUrl": f"https://www.youtube.com/api/timedtext?v={vid}&lang=en",
                                   "name": {"runs": [{"text": "English (auto-generated)"}]},
                                   "languageCode": "en", "kind": "asr"}]}}}
        self._send(200, json.dumps(data), "application/json")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def youtube_session():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeYouTube)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    local = f"http://127.0.0.1:{server.server_address[1]}"

    class ToLocal(HTTPAdapter):
        def send(self, request, **kwargs):
            request.url = request.url.replace("https://www.youtube.com", local, 1)
            return super().send(request, **kwargs)

    session = requests.Session()
    session.mount("https://www.youtube.com", ToLocal())
    yield session
    server.shutdown()


def test_fetch_through_youtube_transcript_api(youtube_session):
    text = fetch_youtube("https://youtu.be/abcdefghijk", http_client=youtube_session)
    assert text == "welcome back to the ultras scale playback & data parallelism (abcdefghijk)"


def test_fetch_failure_is_one_line(youtube_session):
    with pytest.raises(ConfigError) as e:
        fetch_youtube("unavailable", http_client=youtube_session)
    assert "\n" not in str(e.value) and "VideoUnavailable" in str(e.value)


# -- glossary ---------------------------------------------------------------------
def test_the_glossary_is_a_data_file_in_the_package():
    data = resources.files("ultrascale.series").joinpath("glossary.toml")
    assert data.is_file()
    glossary = load_glossary()
    assert glossary["ultras scale playback"] == "Ultra-Scale Playbook"
    assert glossary["pictoron"] == "Picotron"


def test_glossary_fixes_captions_as_whole_words():
    text = ("Welcome back to the ultras scale playback series; see the\nPictoron code. "
            "The playbacks and pictoronic are other words.")
    fixed, counts = apply_glossary(text, load_glossary())
    assert fixed == ("Welcome back to the Ultra-Scale Playbook series; see the\nPicotron code. "
                     "The playbacks and pictoronic are other words.")
    assert counts == {"ultras scale playback": 1, "pictoron": 1}


def test_a_users_glossary_adds_and_overrides(tmp_path):
    user = write(tmp_path, "mine.toml", '[replace]\n"zig zag" = "zig-zag"\n"pictoron" = "picotron (HF)"\n')
    glossary = load_glossary(user)
    fixed, _ = apply_glossary("zig zag ring attention in pictoron", glossary)
    assert fixed == "zig-zag ring attention in picotron (HF)"
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_glossary(write(tmp_path, "bad.toml", "[replace\n"))
    with pytest.raises(ConfigError, match=r"no \[replace\] table"):
        load_glossary(write(tmp_path, "empty.toml", "x = 1\n"))


# -- the prompt -------------------------------------------------------------------
def test_prompt_has_requirements_previous_episodes_transcript_and_schema():
    with open(os.path.join(DATA, "tiny_episode.json")) as f:
        earlier = Episode.from_dict(json.load(f))
    prompt = build_prompt(7, "TRANSCRIPT-TEXT about pipelines", [earlier])
    assert "Ultra-Scale Playbook: Part 7" in prompt
    assert "Exactly 2 hands-on exercises" in prompt and "3 or 4 multiple-choice questions" in prompt
    assert "`7_<slug>.ipynb`" in prompt and "This is episode 7." in prompt
    assert "- Part 6: Averages" in prompt
    assert "  - An all-reduce sums the values of every rank" in prompt
    assert "```\nTRANSCRIPT-TEXT about pipelines\n```" in prompt
    schema_block = prompt.split("```json\n", 1)[1].split("\n```", 1)[0]
    assert json.loads(schema_block) == EPISODE_SCHEMA
    assert "no .cuda()" in prompt.replace("`", "") and "gloo" in prompt
    fix = repair_prompt(["cell 3: quiz: ask 3 or 4", "cell 9 failed when run: ZeroDivisionError"])
    assert "- cell 3: quiz: ask 3 or 4\n- cell 9 failed when run: ZeroDivisionError" in fix
