"""Caption mis-hearings -> what was said ("ultras scale playback" -> "Ultra-Scale Playbook").

Automatic captions mangle the series' proper nouns, and an LLM then repeats
them into the notebook. The list lives in glossary.toml next to this module (a
data file, so it can be edited without touching code); `--glossary FILE` adds
a user's own entries on top.
"""

from __future__ import annotations

import re
from importlib import resources

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from ultrascale.errors import ConfigError


def load_glossary(extra: str | None = None) -> dict[str, str]:
    """The packaged glossary, updated with the [replace] table of `extra` (a TOML file) if given."""
    try:
        text = resources.files("ultrascale.series").joinpath("glossary.toml").read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise ConfigError("the packaged glossary ultrascale/series/glossary.toml is missing; reinstall ultrascale") from e
    table = dict(tomllib.loads(text).get("replace", {}))
    if extra:
        try:
            with open(extra, "rb") as f:
                user = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"--glossary {extra}: {e.strerror}") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--glossary {extra} is not valid TOML ({e})") from e
        if not isinstance(user.get("replace"), dict):
            raise ConfigError(f"--glossary {extra} has no [replace] table of \"heard\" = \"meant\" entries")
        table.update(user["replace"])
    return {str(k).strip(): str(v) for k, v in table.items() if str(k).strip()}


def apply_glossary(text: str, glossary: dict[str, str]) -> tuple[str, dict[str, int]]:
    """`text` with every glossary key replaced, and how often each key was found."""
    counts = {}
    if not glossary:
        return text, counts
    keys = sorted(glossary, key=len, reverse=True)
    spaced = [r"\s+".join(map(re.escape, k.split())) for k in keys]
    pattern = re.compile("|".join(rf"(?<!\w)(?:{k})(?!\w)" for k in spaced), re.IGNORECASE)
    lookup = {" ".join(k.lower().split()): k for k in keys}

    def sub(m):
        key = lookup[" ".join(m.group(0).lower().split())]
        counts[key] = counts.get(key, 0) + 1
        return glossary[key]

    return pattern.sub(sub, text), counts
