"""The JSON schema of an Episode, sent to the LLM as its structured-output format.

It mirrors episode.py field for field (a test keeps the two in step). Servers
that enforce schemas get the counts too (2 exercises, 3-4 questions); lint
checks them again, because many servers only take the schema as a hint.
"""

from __future__ import annotations

_STR = {"type": "string"}


def _obj(properties: dict, optional: tuple = ()) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": [k for k in properties if k not in optional],
        "additionalProperties": False,
    }


CELL = _obj({
    "kind": {"type": "string", "enum": ["markdown", "code"]},
    "source": {"type": "string", "description": "markdown text or Python code"},
    "needs_gpu": {"type": "boolean", "description": "true only for a cell that cannot run without CUDA; "
                                                    "it is skipped on CPU"},
}, optional=("needs_gpu",))

SECTION = _obj({
    "heading": {"type": "string", "description": "section heading, without the leading ##"},
    "cells": {"type": "array", "items": CELL, "minItems": 1},
})

EXERCISE = _obj({
    "title": _STR,
    "instructions": {"type": "string", "description": "markdown: what to write and why"},
    "starter": {"type": "string", "description": "Python the learner completes: imports and signatures "
                                                 "given, the part to write replaced by '# TODO' and "
                                                 "'raise NotImplementedError'; never the answer"},
    "solution": {"type": "string", "description": "the starter with the gap filled in; hidden from the learner"},
    "check": {"type": "string", "description": "Python statements (a function body) that call the learner's "
                                               "code and assert what must hold, each assert with a message "
                                               "saying what is wrong and how to fix it"},
    "hints": {"type": "array", "items": _STR, "minItems": 2, "maxItems": 3,
              "description": "progressive hints, each revealed on demand: a nudge first, nearly the answer last"},
}, optional=("hints",))

QUESTION = _obj({
    "question": {"type": "string", "description": "the question only; its answer is given at the end of the "
                                                  "notebook"},
    "options": {"type": "array", "items": _STR, "minItems": 2, "maxItems": 5},
    "answer": {"type": "integer", "description": "0-based index of the right option"},
    "why": {"type": "string", "description": "one line: why that option is right (shown with the answer, at "
                                             "the end of the notebook)"},
})

REFERENCE = _obj({
    "episode": {"type": "integer", "description": "an earlier episode number"},
    "note": {"type": "string", "description": "what this episode builds on from it"},
})

EPISODE_SCHEMA = _obj({
    "number": {"type": "integer", "minimum": 1},
    "title": {"type": "string", "description": "the topic, shown after 'Part N - '"},
    "slug": {"type": "string", "description": "short snake_case topic for the file name N_slug.ipynb"},
    "subtitle": {"type": "string", "description": "one line under the title; may be empty"},
    "overview": {"type": "array", "items": _STR, "minItems": 2, "description": "what the episode covers, "
                                                                                 "one bullet each"},
    "references": {"type": "array", "items": REFERENCE},
    "sections": {"type": "array", "items": SECTION, "minItems": 1},
    "exercises": {"type": "array", "items": EXERCISE, "minItems": 2, "maxItems": 2},
    "quiz": {"type": "array", "items": QUESTION, "minItems": 3, "maxItems": 4},
    "needs_accelerator": {"type": "boolean", "description": "true only if the notebook cannot teach "
                                                            "anything without a GPU"},
}, optional=("subtitle", "references", "needs_accelerator"))
