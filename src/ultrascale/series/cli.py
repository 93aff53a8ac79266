"""`ultrascale notebook check | run | generate | prompt | import`.

Exit status: 0 done; 1 the notebook breaks the format, fails to run, or was
rejected (the reasons are printed); 2 bad input (one line, nothing written).
Heavy imports (nbformat, nbclient, openai) happen inside the commands, so
registering them costs `ultrascale train` nothing.
"""

from __future__ import annotations

import json
import os
import sys

from ultrascale.errors import ConfigError, positive_number


def add_parser(sub) -> None:
    p = sub.add_parser("notebook", help="the course notebooks: check, run, generate from a transcript, import")
    nsub = p.add_subparsers(dest="notebook_command", required=True, parser_class=type(p))

    c = nsub.add_parser("check", help="lint notebooks against the series' format")
    c.add_argument("files", nargs="+", metavar="FILE", help="notebooks, or directories of them")
    c.add_argument("--json", action="store_true", help="print the violations as a JSON list")
    c.set_defaults(func=cmd_check)

    r = nsub.add_parser("run", help="execute notebooks top to bottom on CPU and prove their exercises")
    r.add_argument("files", nargs="+", metavar="FILE", help="notebooks, or directories of them")
    r.add_argument("--timeout", type=positive_number, default=300, help="seconds one cell may run (default 300)")
    g = r.add_mutually_exclusive_group()
    g.add_argument("--gpu", dest="gpu", action="store_const", const=True, default=None,
                   help="also run cells tagged needs-gpu (default: only if the kernel sees CUDA)")
    g.add_argument("--cpu", dest="gpu", action="store_const", const=False, help="skip cells tagged needs-gpu")
    r.add_argument("--no-exercises", dest="exercises", action="store_false",
                   help="do not prove the exercise checks against starter and solution")
    r.set_defaults(func=cmd_run)

    gr = nsub.add_parser("grade", help="run a learner's completed notebook and say, per exercise, passed or what is wrong")
    gr.add_argument("files", nargs="+", metavar="FILE", help="notebooks, or directories of them")
    gr.add_argument("--timeout", type=positive_number, default=300, help="seconds one cell may run (default 300)")
    gr.add_argument("--json", action="store_true", help="print the grades as JSON")
    gr.set_defaults(func=cmd_grade)

    b = nsub.add_parser("build", help="write a variant of a notebook: --solved puts the reference solutions in place")
    b.add_argument("file", metavar="FILE")
    b.add_argument("--solved", action="store_true", required=True,
                   help="the instructor's version: each exercise's code cell holds its reference solution")
    b.add_argument("-o", "--output", required=True, metavar="OUT.ipynb", help="where to write it")
    b.set_defaults(func=cmd_build)

    gen = nsub.add_parser("generate", help="turn an episode's transcript into a notebook through an LLM")
    _source_args(gen)
    gen.add_argument("--model", default=os.environ.get("OPENAI_MODEL", "gpt-4o-mini"),
                     help="model name (default: $OPENAI_MODEL or gpt-4o-mini)")
    gen.add_argument("--base-url", default=None,
                     help="OpenAI-compatible endpoint, e.g. http://localhost:8000/v1 (default: $OPENAI_BASE_URL "
                          "or OpenAI); the key is read from $OPENAI_API_KEY")
    gen.add_argument("--max-repairs", type=int, default=2,
                     help="times a rejected attempt is sent back with its problems (default 2)")
    gen.add_argument("--retries", type=int, default=4, help="retries on 429, timeouts and connection errors (default 4)")
    gen.add_argument("--retry-wait", type=float, default=2.0,
                     help="first backoff in seconds, doubled at each retry (default 2)")
    gen.add_argument("--request-timeout", type=positive_number, default=600, help="seconds one LLM call may take (default 600)")
    _save_args(gen)
    gen.set_defaults(func=cmd_generate)

    pr = nsub.add_parser("prompt", help="print the prompt for an episode, to paste into a chat window")
    _source_args(pr)
    pr.set_defaults(func=cmd_prompt)

    im = nsub.add_parser("import", help="check and save what a chat returned (JSON, a notebook, or a fenced block)")
    im.add_argument("file", metavar="FILE", help="the chat's answer saved to a file, or - for stdin")
    im.add_argument("--episode", help="the episode number (default: the one in the answer)")
    _save_args(im)
    im.set_defaults(func=cmd_import)


def _source_args(p) -> None:
    p.add_argument("--episode", required=True, help="the episode number N (a positive integer)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--transcript", metavar="FILE", help="transcript: .txt, .srt, .vtt or YouTube .json")
    src.add_argument("--youtube", metavar="URL_OR_ID", help="fetch the captions of a YouTube video, or pick the "
                                                          "episode from a playlist .json (yt-dlp -J)")
    p.add_argument("--previous", metavar="DIR", help="earlier notebooks, for continuity (default: --out, or .)")
    p.add_argument("--glossary", metavar="FILE", help="TOML [replace] table of caption fixes, on top of the "
                                                     "built-in one")


def _save_args(p) -> None:
    p.add_argument("--out", default=".", metavar="DIR", help="where N_topic.ipynb is written (default: .)")
    p.add_argument("--force", action="store_true", help="replace an existing notebook of this episode (only "
                                                        "with one that passes)")
    p.add_argument("--timeout", type=positive_number, default=300, help="seconds one cell may run when checking (default 300)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="print results only")


# -- check, run ---------------------------------------------------------------
def _existing(files) -> None:
    for f in files:
        if os.path.isdir(f):
            raise ConfigError(f"{f} is a directory: give one notebook file in it")
        if not os.path.isfile(f):
            raise ConfigError(f"{f}: no such file")


def _notebooks(paths) -> list[str]:
    """The FILE arguments, a directory standing for the notebooks in it: `check notebooks/`
    reads as "every notebook there", as a linter or a test runner reads a directory."""
    files = [f for p in paths for f in (_in_directory(p) if os.path.isdir(p) else [p])]
    _existing(files)
    return files


def _in_directory(directory: str) -> list[str]:
    """Its own notebooks (not those of .ipynb_checkpoints/), the series' parts by number, then any
    other by name; the generator's rejected attempts (*.rejected.ipynb, kept for their reasons) left out."""
    from ultrascale.series.files import EPISODE_FILE

    def order(path):
        m = EPISODE_FILE.match(os.path.basename(path))
        return (0, int(m.group(1)), path) if m else (1, 0, path)

    found = [os.path.join(directory, n) for n in os.listdir(directory)
             if n.endswith(".ipynb") and not n.endswith(".rejected.ipynb")
             and os.path.isfile(os.path.join(directory, n))]
    if not found:
        raise ConfigError(f"{directory} is a directory with no notebook (*.ipynb) in it: give notebook files, "
                          f"or the directory that holds them")
    return sorted(found, key=order)


def cmd_check(args) -> int:
    from ultrascale.series.lint import lint_file

    args.files = _notebooks(args.files)
    found = [v for f in args.files for v in lint_file(f)]
    if args.json:
        print(json.dumps([v.to_dict() for v in found], indent=1))
    else:
        for v in found:
            print(v.line())
        bad = {v.file for v in found}
        for f in args.files:
            if f not in bad:
                print(f"{f}: ok")
    return 1 if found else 0


def cmd_run(args) -> int:
    from ultrascale.series.execute import run_notebook

    args.files = _notebooks(args.files)
    status = 0
    for f in args.files:
        nb = _read_notebook(f)
        report = run_notebook(nb, timeout=args.timeout, cwd=os.path.dirname(os.path.abspath(f)), gpu=args.gpu,
                              exercises=args.exercises)
        if report.failure:
            print(f"{f}: {report.failure.line()}")
        for e in report.exercises:
            print(f"{f}: {e.line()}")
        if report.skipped:
            print(f"{f}: skipped (needs a GPU): cell{'s' if len(report.skipped) > 1 else ''} "
                  f"{', '.join(map(str, report.skipped))}")
        verdict = "ok" if report.ok else "FAILED"
        print(f"{f}: {verdict}, {len(report.executed)} code cells in {report.seconds:.1f} s")
        status |= 0 if report.ok else 1
    return status


def cmd_grade(args) -> int:
    from ultrascale.series.execute import grade_notebook
    from ultrascale.series.outline import outline

    args.files = _notebooks(args.files)
    status, everything = 0, {}
    for f in args.files:
        nb = _read_notebook(f)
        if not any(e.check is not None for e in outline(nb).exercises):
            raise ConfigError(f"{f} has no exercises to grade (is it a notebook of the series?)")
        report, grades = grade_notebook(nb, timeout=args.timeout, cwd=os.path.dirname(os.path.abspath(f)))
        if not grades:  # the kernel never ran the checks: it did not start, died, or a check timed out
            print(f"{f}: not graded: {report.failure.line() if report.failure else 'no check ran'}", file=sys.stderr)
            status |= 1
            continue
        everything[f] = {"grades": [g.__dict__ for g in grades], "errors": [e.line() for e in report.errors]}
        passed = sum(g.status == "passed" for g in grades)
        status |= 0 if passed == len(grades) else 1
        if args.json:
            continue
        for e in report.errors:
            print(f"{f}: {e.line()}")
        for g in grades:
            print(f"{f}: {g.line()}")
        print(f"{f}: {passed}/{len(grades)} exercises passed in {report.seconds:.1f} s")
    if args.json:
        print(json.dumps(everything, indent=1))
    return status


def cmd_build(args) -> int:
    from ultrascale.series.build import notebook_text, solved
    from ultrascale.series.files import check_writable, write_atomic

    _existing([args.file])
    if os.path.isdir(args.output):
        raise ConfigError(f"-o {args.output} is a directory; give the notebook's file name")
    check_writable(os.path.dirname(os.path.abspath(args.output)), flag="-o")
    from ultrascale.series.outputs import without_outputs

    nb = _read_notebook(args.file)
    out = solved(without_outputs(nb))  # the outputs are those of the starters: not the solved notebook's
    n = sum(1 for c in out.cells if c.get("metadata", {}).get("ultrascale", {}).get("role") == "starter")
    if n == 0:
        raise ConfigError(f"{args.file} has no exercise with a reference solution in its metadata")
    write_atomic(args.output, notebook_text(out))
    print(f"wrote {args.output} ({n} exercises solved)")
    return 0


def _read_notebook(path: str):
    import nbformat

    try:
        return nbformat.read(path, as_version=4)
    except Exception as e:  # not JSON, not a notebook
        raise ConfigError(f"{path} is not a readable notebook ({str(e).splitlines()[0][:200]})") from e


# -- generate, prompt, import -------------------------------------------------
def _transcript(args, progress):
    from ultrascale.series.glossary import apply_glossary, load_glossary
    from ultrascale.series.transcript import read_transcript, youtube_transcript

    n = args.episode_n
    glossary = load_glossary(args.glossary)
    if args.transcript:
        text = read_transcript(args.transcript, n)
    else:
        with progress.step(f"fetching the captions of {args.youtube}"):
            text = youtube_transcript(args.youtube, n)
    text, fixes = apply_glossary(text, glossary)
    fixed = ", ".join(f"{k!r} x{c}" for k, c in sorted(fixes.items()))
    progress.info(f"transcript: {len(text):,} characters" + (f"; caption fixes: {fixed}" if fixed else ""))
    return text


def _previous(args, progress):
    from ultrascale.series.generate import previous_episodes

    directory = args.previous or getattr(args, "out", None) or "."
    if args.previous and not os.path.isdir(args.previous):
        raise ConfigError(f"--previous {args.previous} is not a directory")
    return previous_episodes(directory, args.episode_n, progress)


def _no_existing(args, n) -> None:
    from ultrascale.series.files import episode_files

    if os.path.isdir(args.out) and not args.force:
        existing = episode_files(args.out, n)
        if existing:
            raise ConfigError(f"{existing[0]} already holds episode {n}; pass --force to replace it "
                              f"(a notebook that fails the checks never replaces it)")


def cmd_generate(args) -> int:
    from ultrascale.series.files import check_writable, episode_number
    from ultrascale.series.generate import generate
    from ultrascale.series.progress import Progress

    progress = Progress(args.progress)
    n = args.episode_n = episode_number(args.episode)
    if args.max_repairs < 0 or args.retries < 0:
        raise ConfigError("--max-repairs and --retries must be 0 or more")
    check_writable(args.out)
    _no_existing(args, n)
    key = os.environ.get("OPENAI_API_KEY", "").strip()
    if not key:
        raise ConfigError("no API key: set OPENAI_API_KEY (any non-empty value for a local server)")
    text = _transcript(args, progress)
    previous = _previous(args, progress)
    from ultrascale.series.llm import ChatModel

    model = ChatModel(args.model, base_url=args.base_url, api_key=key, retries=args.retries,
                      retry_wait=args.retry_wait, timeout=args.request_timeout,
                      on_wait=lambda s, why: progress.info(f"{why}; retrying in {s:.1f} s"))
    return generate(n, text, previous, model, args.out, args.max_repairs, args.timeout, args.force, progress)


def cmd_prompt(args) -> int:
    from ultrascale.series.files import episode_number
    from ultrascale.series.progress import Progress
    from ultrascale.series.prompt import build_prompt

    progress = Progress(True)
    args.episode_n = episode_number(args.episode)
    text = _transcript(args, progress)
    prompt = build_prompt(args.episode_n, text, _previous(args, progress))
    try:
        print(prompt, flush=True)
    except BrokenPipeError:  # `| head`: the reader has seen enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def cmd_import(args) -> int:
    from ultrascale.series.files import check_writable, episode_number
    from ultrascale.series.generate import assess, keep
    from ultrascale.series.progress import Progress

    progress = Progress(args.progress)
    n = episode_number(args.episode) if args.episode is not None else None
    check_writable(args.out)
    try:
        if args.file == "-":
            text = sys.stdin.read()
        else:
            with open(args.file, encoding="utf-8-sig") as f:
                text = f.read()
    except FileNotFoundError as e:
        raise ConfigError(f"{args.file}: no such file") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{args.file} cannot be read as UTF-8 text ({e})") from e
    if not text.strip():
        raise ConfigError(f"{args.file} is empty: paste the chat's answer into it")
    attempt = assess(None, n, args.timeout, progress, text=text)
    number = n or (attempt.episode.number if attempt.episode else 0)
    if number <= 0:
        raise ConfigError(f"{args.file} does not say which episode it is; pass --episode N")
    if attempt.ok:
        _no_existing(args, number)
    path, good = keep(attempt, args.out, number, args.force)
    if good:
        print(f"wrote {path}")
        return 0
    for p in attempt.problems:
        print(f"  - {p}")
    print(f"rejected; kept as {path} with the reasons")
    return 1
