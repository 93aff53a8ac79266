"""`ultrascale generate`: text from a checkpoint written by `train --save`, in any layout.

  ultrascale generate CHECKPOINT_DIR --prompt TEXT [--max-new-tokens 64] [--temperature 0]
                      [--top-k 0] [--seed N] [--device auto|cpu|cuda] [--dtype fp32|bf16]
                      [--tokenizer DIR|bytes] [--no-stop-at-eos]

The checkpoint is read whole into one process (the tensors assembled from every rank's
chunks, as `export` does) and the model decodes with a KV cache: the prompt in one
forward, then one position per token. The prompt and its continuation go to stdout as
they come; a line on stderr says how many tokens were made, how fast, and why it stopped
(--max-new-tokens, the end-of-text token, or the model's max_seq_len).

Temperature 0 is greedy decoding (the most likely token each time); above 0, the next
token is drawn from softmax(logits / temperature), over the top_k most likely only when
--top-k is given, with a generator seeded by --seed. A mixture-of-experts model trained
with a capacity factor routes each forward's tokens under that forward's own capacity:
a single new token is never dropped, the prompt's tokens can be.

Importing this module costs argparse only.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="write text with a model trained by `ultrascale train --save`")
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a directory written by `ultrascale train --save`")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to add at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy, the most likely token each time (default); above 0: sample from "
                        "softmax(logits / temperature)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample among the K most likely tokens only (default 0: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the model runs (default auto: cuda when there is one)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="compute dtype (default fp32)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="tokenizer directory, or 'bytes' (default: the run's --tokenizer)")
    p.add_argument("--stop-at-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="stop at the end-of-text token (default: stop)")
    p.set_defaults(func=cmd_generate)


def check_args(args) -> None:
    """The flags alone, before anything is read: one ConfigError naming the flag and the fix."""
    from ultrascale.errors import ConfigError

    if not args.prompt:
        raise ConfigError("--prompt is empty: give the text to continue, e.g. --prompt 'def main('")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ConfigError(f"--temperature must be 0 (greedy) or positive, got {args.temperature}")
    if args.top_k < 0:
        raise ConfigError(f"--top-k must be 0 (all tokens) or positive, got {args.top_k}")
    if args.max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens must be 0 or positive, got {args.max_new_tokens}")
    if not 0 <= args.seed < 2**64:
        raise ConfigError(f"--seed must be within 0..2^64-1, got {args.seed}")


def pick_device(name: str):
    import torch

    from ultrascale.errors import ConfigError

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: this torch sees no CUDA device: use --device cpu (or auto)")
    return torch.device(name)


def next_token(logits, temperature: float = 0.0, top_k: int = 0, generator=None) -> int:
    """One token from the logits [vocab] of the last position."""
    import torch

    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    ids = None
    if top_k and top_k < logits.shape[-1]:
        logits, ids = logits.topk(top_k)
    # Drawn on the CPU: a seed gives the same text whatever the device.
    choice = int(torch.multinomial(logits.softmax(-1).cpu(), 1, generator=generator))
    return choice if ids is None else int(ids[choice])


def generate(model, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, generator=None,
             eos_id: int | None = None, on_token=None) -> list[int]:
    """The ids of up to `max_new_tokens` tokens after `prompt_ids` (a 1-D sequence), decoded with a
    KV cache: one forward over the prompt, then one forward of one position per new token.

    Stops early at `eos_id` (which is returned, as the last id) and where the sequence reaches the
    model's max_seq_len. `generator`: a CPU torch.Generator for sampling (temperature > 0).
    `on_token(id)` is called as each token is chosen."""
    import torch

    from ultrascale.model.transformer import KVCache

    device = next(model.parameters()).device
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).view(1, -1)
    n = min(max_new_tokens, model.cfg.max_seq_len - ids.shape[1])
    if n <= 0:
        return []
    cache = KVCache(ids.shape[1] + n - 1)  # the last token chosen is never fed back
    new: list[int] = []
    with torch.no_grad():
        logits = model(ids, cache=cache)[0, -1]
        while True:
            token = next_token(logits, temperature, top_k, generator)
            new.append(token)
            if on_token is not None:
                on_token(token)
            if token == eos_id or len(new) == n:
                return new
            logits = model(torch.tensor([[token]], device=device), cache=cache)[0, -1]


class _Printer:
    """Writes the continuation as it grows. A token can end inside a character (a byte of UTF-8, a
    piece of a BPE merge): the text decoded so far is printed only as far as it is settled, what
    follows a replacement character at its end waits for the next token. The end-of-text token
    ends the text, it is not part of it."""

    def __init__(self, tokenizer, out, eos_id=None):
        self.tokenizer, self.out, self.eos_id, self.ids, self.shown = tokenizer, out, eos_id, [], ""

    def __call__(self, token: int) -> None:
        if token != self.eos_id:
            self.ids.append(token)
            self.show(final=False)

    def show(self, final: bool) -> None:
        text = self.tokenizer.decode(self.ids)
        if not final:
            text = text.rstrip("\ufffd")
        if text.startswith(self.shown):
            self.out.write(text[len(self.shown):])
        else:  # a tokenizer that rewrote what came before (rare): the rest, once, at the end
            if not final:
                return
            self.out.write(text[len(os.path.commonprefix([text, self.shown])):])
        self.shown = text
        self.out.flush()


def cmd_generate(args) -> int:
    from ultrascale.errors import ConfigError
    from ultrascale.train.record import read_record
    from ultrascale.train.resume import latest

    check_args(args)
    path = args.checkpoint.rstrip("/") or "/"
    if not os.path.isdir(path) and not os.path.isdir(path + ".old"):  # (.old: a save stopped between renames)
        raise ConfigError(f"checkpoint {args.checkpoint}: no such checkpoint directory: give a directory written by "
                          f"`ultrascale train --save DIR`")
    args.checkpoint = latest(path)  # a directory of per-step saves (--keep-last): the latest
    record = read_record(args.checkpoint, what="checkpoint")  # the shape and the run's tokenizer
    import torch

    from ultrascale.parallel.precision import DTYPES, check_dtype_support
    from ultrascale.train.checkpoint import trained_model
    from ultrascale.train.data import check_run_tokenizer, load_tokenizer

    device = pick_device(args.device)
    cfg = record.config.model
    spec = args.tokenizer if args.tokenizer is not None else record.config.train.tokenizer
    if spec not in ("", "bytes") and not os.path.isdir(spec):
        if args.tokenizer is not None:
            raise ConfigError(f"--tokenizer {spec}: not a directory; give 'bytes' or a local tokenizer directory")
        raise ConfigError(f"tokenizer directory {spec} (the run's --tokenizer) is gone: pass --tokenizer DIR")
    if args.tokenizer is None:
        check_run_tokenizer(spec, record.tokenizer, f"checkpoint {args.checkpoint}")
    tokenizer = load_tokenizer(spec)
    prompt = tokenizer.encode(args.prompt)
    if len(prompt) == 0:
        raise ConfigError("--prompt encodes to no tokens: give some text to continue")
    if len(prompt) >= cfg.max_seq_len:
        raise ConfigError(f"--prompt is {len(prompt)} tokens, the model reads at most {cfg.max_seq_len} "
                          f"(max_seq_len) and needs room for one more: shorten the prompt")
    if int(prompt.max()) >= cfg.vocab_size:
        raise ConfigError(f"--prompt: the tokenizer {spec or 'bytes'} gives token id {int(prompt.max())}, the model's "
                          f"vocabulary has {cfg.vocab_size}: pass the run's --tokenizer")
    check_dtype_support(args.dtype, device)

    model = trained_model(args.checkpoint, device).eval()  # the weights and the router biases
    with torch.no_grad():  # the parameters only, as training casts them: RoPE's tables and router biases stay fp32
        for p in model.parameters():
            p.data = p.data.to(DTYPES[args.dtype])
    generator = torch.Generator().manual_seed(args.seed)
    eos = tokenizer.eos_id if args.stop_at_eos else None

    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    printer = _Printer(tokenizer, sys.stdout, eos)
    start = time.perf_counter()
    new = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, generator, eos, printer)
    seconds = time.perf_counter() - start
    printer.show(final=True)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if eos is not None and new and new[-1] == eos:
        why = "at the end-of-text token"
    elif len(prompt) + len(new) >= cfg.max_seq_len and len(new) < args.max_new_tokens:
        why = f"at the model's max_seq_len ({cfg.max_seq_len} tokens, the prompt's {len(prompt)} included)"
    else:
        why = "at --max-new-tokens"
    print(f"generated {len(new)} tokens in {seconds:.2f} s ({len(new) / max(seconds, 1e-9):,.1f} tokens/s, "
          f"prefill included; {args.dtype} on {device.type}), stopped {why}", file=sys.stderr)
    return 0
