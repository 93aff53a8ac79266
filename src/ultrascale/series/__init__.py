"""The course: "Ultra-Scale Playbook: Part N", one notebook per video episode.

The format is code here, so a notebook that breaks it is refused before anyone
reads it:

episode     the structure of an episode (dataclasses) and its JSON form
schema      the JSON schema of that form, for an LLM's structured output
build       Episode -> nbformat 4 notebook (solutions hidden in metadata)
outline     notebook -> where the title, overview, exercises and quiz are; -> Episode
lint        the format rules, one violation per line
execute     run a notebook on CPU with nbclient; exercise checks must fail on
            the starter code and pass on the hidden solution
transcript  captions from .txt, .srt, .vtt, YouTube JSON or YouTube itself
glossary    caption mis-hearings and what was said (glossary.toml, editable)
prompt      what the LLM is asked, and how a rejected attempt is sent back
llm         an OpenAI-compatible chat endpoint, with retries and JSON extraction
generate    ask -> build -> lint -> run -> repair, and save only what passes
files       file names of the series and writes that are never half done
progress    what the command is doing while it waits
cli         the `ultrascale notebook` command

Nothing here imports nbclient or openai at module import time except the
modules that need them (execute, llm), so `ultrascale train` stays fast.
"""
