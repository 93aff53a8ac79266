"""An episode's transcript as plain text, from whatever the captions came as.

Files, by extension:
  .srt   SubRip: numbered cues with `00:00:01,000 --> 00:00:04,000` times
  .vtt   WebVTT: YouTube's auto captions repeat each line in the next cue
         (rolling captions); repeats are dropped
  .json  YouTube JSON: youtube-transcript-api's list of {"text", "start",
         "duration"} snippets, YouTube's own json3 ({"events": [{"segs": ...}]}),
         or a playlist (yt-dlp `--flat-playlist -J`: {"entries": [{"id", "title"}]}),
         from which the episode is picked by its number
  other  plain text
`--youtube URL_OR_ID` fetches the captions with youtube-transcript-api 1.2+
(`YouTubeTranscriptApi().fetch`); a playlist JSON file given there works the
same way.

Episode N in a playlist is the one title that says "Part N", "Episode N",
"Ep. N" or "#N", or starts with "N " / "N." / "N:" - compared as numbers,
so episode 1 is not 10, 11, nor "ZeRO-1".
"""

from __future__ import annotations

import json
import os
import re
from urllib.parse import parse_qs, urlparse

from ultrascale.errors import ConfigError

VIDEO_ID = re.compile(r"^[A-Za-z0-9_-]{11}$")
TIMING = re.compile(r"^\s*(?:\d+:)?\d{1,2}:\d{2}[.,]\d{3}\s*-->\s*(?:\d+:)?\d{1,2}:\d{2}[.,]\d{3}.*$")
EPISODE_IN_TITLE = re.compile(r"(?:\bpart|\bepisode|\bep\.?|#)\s*(\d+)(?![\d.]\d)", re.I)
LEADING_NUMBER = re.compile(r"^\s*(\d+)\s*(?:[.:)\-\u2013\u2014]\s|\s)")


def read_transcript(path: str, episode: int | None = None) -> str:
    """The text of a transcript file; a ConfigError if it cannot be read or says nothing."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            raw = f.read()
    except FileNotFoundError as e:
        raise ConfigError(f"--transcript {path}: no such file") from e
    except IsADirectoryError as e:
        raise ConfigError(f"--transcript {path} is a directory; give the transcript file") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"--transcript {path} is not UTF-8 text; save it as UTF-8") from e
    except OSError as e:
        raise ConfigError(f"--transcript {path}: {e.strerror}") from e
    ext = os.path.splitext(path)[1].lower()
    if ext == ".srt":
        text = from_srt(raw)
    elif ext == ".vtt":
        text = from_vtt(raw)
    elif ext == ".json":
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--transcript {path} is not valid JSON (line {e.lineno}: {e.msg})") from e
        text = from_youtube_json(data, episode, source=path)
    else:
        text = raw
    text = _squash(text)
    if not text:
        raise ConfigError(f"--transcript {path} is empty: there is nothing to turn into a notebook")
    return text


def _squash(text: str) -> str:
    return re.sub(r"[ \t]+", " ", re.sub(r"\s*\n\s*", "\n", text)).strip()


def from_srt(raw: str) -> str:
    lines = []
    for line in raw.splitlines():
        s = line.strip()
        if not s or s.isdigit() or TIMING.match(s):
            continue
        lines.append(re.sub(r"<[^>]+>", "", s))
    return " ".join(_drop_repeats(lines))


def from_vtt(raw: str) -> str:
    lines, in_note = [], False
    for line in raw.splitlines():
        s = line.strip()
        if not s:
            in_note = False
            continue
        if in_note or s.startswith(("WEBVTT", "Kind:", "Language:", "STYLE", "REGION")):
            continue
        if s.startswith("NOTE"):
            in_note = True
            continue
        if TIMING.match(s) or "-->" in s:
            continue
        s = re.sub(r"<[^>]+>", "", s).strip()  # <00:00:01.000><c> word timings
        if s:
            lines.append(s)
    return " ".join(_drop_repeats(lines))


def _drop_repeats(lines: list[str]) -> list[str]:
    # Rolling captions show each line twice, once at the bottom and once moved up.
    out = []
    for s in lines:
        if not out or s != out[-1]:
            out.append(s)
    return out


def from_youtube_json(data, episode: int | None = None, source: str = "the JSON") -> str:
    """Text from snippets, json3 events, or (with `episode`) a playlist entry."""
    if isinstance(data, dict) and isinstance(data.get("entries"), list) or (
            isinstance(data, list) and data and isinstance(data[0], dict) and "title" in data[0]
            and "text" not in data[0]):
        entry = episode_entry(data["entries"] if isinstance(data, dict) else data, episode, source)
        inline = entry.get("transcript") or entry.get("snippets")
        if inline:
            return from_youtube_json(inline if not isinstance(inline, str) else [{"text": inline}])
        video = entry.get("id") or entry.get("url")
        if not video:
            raise ConfigError(f"{source}: the entry {entry.get('title')!r} has no video id")
        return fetch_youtube(video)
    if isinstance(data, dict) and isinstance(data.get("events"), list):  # json3
        return " ".join("".join(s.get("utf8", "") for s in ev.get("segs", [])).strip()
                        for ev in data["events"] if isinstance(ev, dict))
    if isinstance(data, dict) and isinstance(data.get("snippets"), list):
        data = data["snippets"]
    if isinstance(data, list) and all(isinstance(s, dict) and "text" in s for s in data):
        return " ".join(str(s["text"]).replace("\n", " ") for s in data)
    raise ConfigError(f"{source} is not a YouTube transcript: expected a list of {{\"text\": ...}} snippets, "
                      f"json3 events, or a playlist with entries")


def episode_of(title: str) -> int | None:
    """The episode number a video title states, if it states exactly one."""
    found = {int(n) for n in EPISODE_IN_TITLE.findall(title)}
    if not found:
        m = LEADING_NUMBER.match(title)
        found = {int(m.group(1))} if m else set()
    return found.pop() if len(found) == 1 else None


def episode_entry(entries: list, episode: int | None, source: str = "the playlist") -> dict:
    """The one playlist entry whose title is episode `episode`."""
    if episode is None:
        raise ConfigError(f"{source} is a playlist: pass --episode to pick the video")
    matches = [e for e in entries if isinstance(e, dict) and episode_of(str(e.get("title", ""))) == episode]
    if not matches:
        raise ConfigError(f"{source}: no video title says episode {episode} (of {len(entries)} entries); "
                          f"titles need 'Part {episode}' or 'Episode {episode}'")
    if len(matches) > 1:
        titles = ", ".join(repr(e.get("title")) for e in matches[:3])
        raise ConfigError(f"{source}: {len(matches)} videos say episode {episode} ({titles}); "
                          f"pass the video with --youtube URL")
    return matches[0]


def video_id(url_or_id: str) -> str:
    """The 11-character video id of a YouTube URL (watch, youtu.be, shorts, embed, live) or id."""
    s = url_or_id.strip()
    if VIDEO_ID.match(s):
        return s
    u = urlparse(s if "://" in s else "https://" + s)
    host = (u.hostname or "").lower()
    candidate = None
    if host.endswith("youtu.be"):
        candidate = u.path.strip("/").split("/")[0]
    elif host.endswith("youtube.com") or host.endswith("youtube-nocookie.com"):
        q = parse_qs(u.query)
        if "v" in q:
            candidate = q["v"][0]
        elif "list" in q:
            raise ConfigError("--youtube got a playlist URL; youtube-transcript-api cannot list playlists: "
                              "export it with `yt-dlp --flat-playlist -J URL > playlist.json` and pass "
                              "--youtube playlist.json --episode N")
        else:
            parts = [p for p in u.path.split("/") if p]
            if len(parts) >= 2 and parts[0] in ("shorts", "embed", "live", "v"):
                candidate = parts[1]
    if candidate and VIDEO_ID.match(candidate):
        return candidate
    raise ConfigError(f"--youtube {url_or_id!r} is not a YouTube video URL or 11-character video id")


def youtube_transcript(url_or_id: str, episode: int | None = None, http_client=None) -> str:
    """--youtube: a video URL or id, or a playlist JSON file from which `episode` is picked."""
    if url_or_id.lower().endswith(".json") and os.path.exists(url_or_id):
        return read_transcript(url_or_id, episode)
    return fetch_youtube(url_or_id, http_client)


def fetch_youtube(url_or_id: str, http_client=None, languages=("en",)) -> str:
    """The captions of one video through youtube-transcript-api 1.2+ (`http_client`: a requests.Session)."""
    vid = video_id(url_or_id)
    try:
        from youtube_transcript_api import YouTubeTranscriptApi
    except ImportError as e:
        raise ConfigError("--youtube needs youtube-transcript-api: pip install 'ultrascale[youtube]'") from e
    try:
        fetched = YouTubeTranscriptApi(http_client=http_client or _session()).fetch(vid, languages=languages)
    except Exception as e:  # the library's errors and requests' (no network, DNS, timeouts)
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ConfigError(f"--youtube {vid}: could not fetch the captions ({type(e).__name__}: {first})") from e
    text = _squash(" ".join(s.text.replace("\n", " ") for s in fetched.snippets))
    if not text:
        raise ConfigError(f"--youtube {vid}: the captions are empty")
    return text


def _session(timeout: float = 30.0):
    """A requests.Session whose requests give up after `timeout` seconds instead of hanging."""
    import requests
    from requests.adapters import HTTPAdapter

    class Timeout(HTTPAdapter):
        def send(self, request, **kwargs):
            if kwargs.get("timeout") is None:
                kwargs["timeout"] = timeout
            return super().send(request, **kwargs)

    s = requests.Session()
    s.mount("https://", Timeout())
    s.mount("http://", Timeout())
    return s
