"""`ultrascale generate`: decoding with a KV cache is the full forward, one position at a time;
the text of a checkpoint trained in a parallel layout is transformers' own greedy text; sampling
follows its seed; bad input is one line.

Models are tiny and built or trained here; nothing is downloaded.
"""

import json

import pytest
import torch

from ultrascale.cli import main
from ultrascale.generate import generate, next_token
from ultrascale.model import build_model, get_preset
from ultrascale.model.transformer import KVCache
from ultrascale.testing.cli import ultrascale
from ultrascale.train.checkpoint import read_full_state
from ultrascale.train.data import load_tokenizer

TOL = 1e-5  # max |logits difference|, fp32
NEW = 32  # tokens generated in the comparisons
PROMPT = "def load(fp, *, cls=None):\n    "


def wide(cfg, seed=0):
    """A model with weights wider than a fresh initialisation (logits O(1)): a misplaced key or a
    wrong rotation moves the logits by far more than the tolerance."""
    model = build_model(cfg, seed=seed).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def decoded(model, tokens, cache=None, wrong_positions=False):
    """The logits of every position, as generation computes them: the first 8 positions in one
    forward (the prompt), then 3 in one forward, then one position per forward."""
    cache = KVCache(tokens.shape[1]) if cache is None else cache
    steps = [(0, 8), (8, 11)] + [(i, i + 1) for i in range(11, tokens.shape[1])]
    out = []
    for a, b in steps:
        # The wrong variant: every new token rotated as if it stood at the start of the sequence.
        positions = torch.arange(b - a) if wrong_positions else None
        out.append(model(tokens[:, a:b], positions=positions, cache=cache))
    return torch.cat(out, dim=1)


class ForgetfulCache(KVCache):
    """A wrong cache: each forward's keys and values are written, but only they are attended to."""

    def extend(self, layer, k, v):
        super().extend(layer, k, v)
        return k, v


SHAPES = {
    "gqa": get_preset("tiny", kv_heads=2),  # 8 query heads share 2 key/value heads
    "moe": get_preset("tiny-moe", kv_heads=2, layers=3, moe_every=2),  # a dense block, an MoE block, a dense one
}


@pytest.mark.parametrize("shape", SHAPES)
def test_decoding_with_the_cache_gives_the_full_forwards_logits(shape):
    model = wide(SHAPES[shape])
    tokens = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        diff = (decoded(model, tokens) - full).abs().max().item()
        # The check can fail: a cache that is not read, or RoPE at the wrong positions, is off by far more.
        forgetful = (decoded(model, tokens, ForgetfulCache(24)) - full).abs().max().item()
        unrotated = (decoded(model, tokens, wrong_positions=True) - full).abs().max().item()
    print(f"{shape}: max |logits diff| {diff:.2e}; forgetful cache {forgetful:.2e}, RoPE at 0 {unrotated:.2e}")
    assert diff < TOL
    assert forgetful > 100 * TOL and unrotated > 100 * TOL
    # And the first 8 positions, the prefill, alone were already right (only the later ones moved).
    with torch.no_grad():
        prefill = decoded(model, tokens, wrong_positions=True)[:, :8]
    assert (prefill - full[:, :8]).abs().max().item() < TOL


def test_the_prompt_into_an_empty_cache_is_the_training_forward_bit_for_bit():
    model = wide(SHAPES["gqa"])
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(tokens), model(tokens, cache=None))
        # The prompt into an empty cache is the training forward's own attention call: bit for bit.
        assert torch.equal(model(tokens), model(tokens, cache=KVCache(16)))


# -- a checkpoint of a parallel layout, and transformers --------------------------------------------
# A transformers Llama with wide random weights, GQA (4 heads, 2 key/value heads), a RoPE base other
# than the default, and the byte tokenizer's vocabulary. Its output matrix is wider still: the
# greedy choice then beats the runner-up by 0.1 or more at each of the tokens compared (measured),
# four orders of magnitude above what the two implementations' logits differ by, so equal ids are
# no accident of rounding. (A model trained from scratch for seconds repeats one byte.)
LLAMA = dict(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=50000.0)
MAX_SEQ_LEN = LLAMA["max_position_embeddings"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """That Llama trained 3 steps on 2 processes with --tp 2 (the vocabulary of 257 padded to 258
    rows there) and saved; and the checkpoint exported for transformers. The learning rate is
    small, so the weights, and the margins above, do not depend on the data."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("generate")
    torch.manual_seed(1)
    start = LlamaForCausalLM(LlamaConfig(**LLAMA))
    with torch.no_grad():
        for name, p in start.named_parameters():
            std = 1.0 if name == "lm_head.weight" else 0.1
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else std * torch.randn_like(p))
    start.save_pretrained(root / "start")
    (root / "data.txt").write_text(open(json.decoder.__file__).read())
    ck, hf = str(root / "ck"), str(root / "hf")
    r = ultrascale("train", "--init-from", f"hf:{root / 'start'}", "--nproc", "2", "--tp", "2", "--seq-len", "32",
                   "--micro-batch", "4", "--steps", "3", "--lr", "1e-7", "--data", str(root / "data.txt"),
                   "--save", ck, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert main(["export", "--hf", hf, ck]) == 0
    return ck, hf


def ours(ck):
    record, state = read_full_state(ck)
    return build_model(record.config.model, seed=0, source=state).eval()


def test_greedy_text_is_transformers_greedy_text(trained):
    from transformers import LlamaForCausalLM

    ck, hf = trained
    tok = load_tokenizer("bytes")
    prompt = tok.encode(PROMPT).long()
    theirs_model = LlamaForCausalLM.from_pretrained(hf).eval()
    with torch.no_grad():
        out = theirs_model.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), do_sample=False,
                                    max_new_tokens=NEW, pad_token_id=0)
    theirs = out[0, len(prompt):].tolist()
    model = ours(ck)
    mine = generate(model, prompt, NEW)
    assert mine == theirs, (mine, theirs)
    # The comparison means something: the chosen token beat the runner-up at every step by far more
    # than the two implementations' logits differ (1e-5), and the text is not one token repeated.
    with torch.no_grad():
        logits = model(torch.cat([prompt, torch.tensor(mine[:-1])])[None])[0, len(prompt) - 1:]
    top2 = logits.topk(2).values
    margin = (top2[:, 0] - top2[:, 1]).min().item()
    print(f"greedy: {NEW} tokens equal to transformers'; smallest top-1 margin {margin:.1e}; {tok.decode(mine)!r}")
    assert margin > 100 * TOL and len(set(mine)) > NEW // 4
    # The command, end to end, in a process of its own: the prompt and the same continuation.
    r = ultrascale("generate", ck, "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--no-stop-at-eos")
    assert r.returncode == 0, r.stderr
    assert r.stdout == PROMPT + tok.decode(theirs) + "\n"
    assert f"generated {NEW} tokens" in r.stderr and "tokens/s" in r.stderr and "--max-new-tokens" in r.stderr


def test_sampling_follows_the_seed_and_top_k_1_is_greedy(trained):
    ck, _ = trained
    model = ours(ck)
    prompt = load_tokenizer("bytes").encode(PROMPT)

    def sample(seed, **kw):
        return generate(model, prompt, NEW, generator=torch.Generator().manual_seed(seed), **kw)

    def ranks(new):
        """Where each chosen token stood among the model's logits at its position (0: the greedy choice)."""
        with torch.no_grad():
            logits = model(torch.cat([prompt, torch.tensor(new[:-1], dtype=prompt.dtype)])[None].long())[0]
        chosen = logits[len(prompt) - 1:].gather(1, torch.tensor(new)[:, None])
        return (logits[len(prompt) - 1:] > chosen).sum(1).tolist()

    greedy = generate(model, prompt, NEW)
    a, b, c = sample(7, temperature=4.0), sample(7, temperature=4.0), sample(8, temperature=4.0)
    assert a == b and a != c and a != greedy
    assert sample(7, temperature=4.0, top_k=1) == sample(8, temperature=0.5, top_k=1) == greedy
    top3 = sample(7, temperature=4.0, top_k=3)
    assert max(ranks(top3)) <= 2 and max(ranks(top3)) > 0 and max(ranks(a)) > 2
    # And on logits whose order is known: top-2 draws the two largest only, both of them.
    drawn = {next_token(torch.tensor([0.0, 3.0, 1.0, 2.0]), 10.0, 2, torch.Generator().manual_seed(s))
             for s in range(50)}
    assert drawn == {1, 3}
    # The command with a seed writes the text the library draws with that seed.
    r = ultrascale("generate", ck, "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--temperature", "4",
                   "--top-k", "3", "--seed", "7", "--no-stop-at-eos")
    assert r.returncode == 0 and r.stdout == PROMPT + load_tokenizer("bytes").decode(top3) + "\n", r.stderr


def test_generation_stops_at_max_seq_len_and_says_so(trained):
    ck, _ = trained
    prompt = "x" * (MAX_SEQ_LEN - 6)  # room for 6 tokens
    r = ultrascale("generate", ck, "--prompt", prompt, "--max-new-tokens", "20", "--no-stop-at-eos")
    assert r.returncode == 0, r.stderr
    assert "generated 6 tokens" in r.stderr and f"max_seq_len ({MAX_SEQ_LEN} tokens" in r.stderr
    tok = load_tokenizer("bytes")
    new = generate(ours(ck), tok.encode(prompt), 20)
    assert len(new) == 6 and r.stdout == prompt + tok.decode(new) + "\n"


def test_bf16_generates_on_the_cpu(trained):
    ck, _ = trained
    r = ultrascale("generate", ck, "--prompt", PROMPT, "--max-new-tokens", "8", "--dtype", "bf16", "--device", "cpu",
                   "--no-stop-at-eos")
    assert r.returncode == 0 and r.stdout.startswith(PROMPT), r.stderr
    assert "generated 8 tokens" in r.stderr and "bf16 on cpu" in r.stderr


def test_generation_stops_at_the_end_of_text_token():
    model = wide(SHAPES["gqa"])
    prompt = load_tokenizer("bytes").encode("abc")
    free = generate(model, prompt, 12)
    eos = free[3]  # call the fourth token chosen the end of text: generation ends there, with it
    assert generate(model, prompt, 12, eos_id=eos) == free[:free.index(eos) + 1]


def test_the_text_is_printed_as_it_settles():
    import io

    from ultrascale.generate import _Printer

    # Byte tokens that end inside a UTF-8 character are held back until it is whole; EOS is not text.
    out, seen = io.StringIO(), []
    printer = _Printer(load_tokenizer("bytes"), out, eos_id=256)
    for token in [*"é€ a".encode(), 256]:
        printer(token)
        seen.append(out.getvalue())
    printer.show(final=True)
    assert out.getvalue() == "é€ a" and not any("\ufffd" in text for text in seen)
    assert seen[:6] == ["", "é", "é", "é", "é€", "é€ "]


# -- bad input: one line, exit 2 --------------------------------------------------------------------
def test_bad_input_is_one_line_and_exit_2(trained, tmp_path):
    ck, _ = trained
    (tmp_path / "not_a_checkpoint").mkdir()
    cases = [
        ([str(tmp_path / "nothing"), "--prompt", "a"], "no such checkpoint directory: give a directory written by"),
        ([str(tmp_path / "not_a_checkpoint"), "--prompt", "a"], "no meta.json"),
        ([ck, "--prompt", "a", "--temperature", "-0.5"], "--temperature must be 0 (greedy) or positive, got -0.5"),
        ([ck, "--prompt", "a", "--top-k", "-1"], "--top-k must be 0 (all tokens) or positive, got -1"),
        ([ck, "--prompt", "a", "--temperature", "nan"], "--temperature must be 0 (greedy) or positive, got nan"),
        ([ck, "--prompt", "a", "--max-new-tokens", "-3"], "--max-new-tokens must be 0 or positive, got -3"),
        ([ck, "--prompt", "a", "--seed", "-1"], "--seed must be within 0..2^64-1, got -1"),
        ([ck, "--prompt", ""], "--prompt is empty"),
        ([ck, "--prompt", "x" * 300], f"--prompt is 300 tokens, the model reads at most {MAX_SEQ_LEN} (max_seq_len)"),
        ([ck, "--prompt", "a", "--tokenizer", str(tmp_path / "gone")], "not a directory; give 'bytes' or a local"),
        ([ck], "the following arguments are required: --prompt"),
    ]
    if not torch.cuda.is_available():
        cases.append(([ck, "--prompt", "a", "--device", "cuda"], "--device cuda: this torch sees no CUDA device"))
    for args, message in cases:
        r = ultrascale("generate", *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and message in lines[0], (args, r.stderr)
        assert "Traceback" not in r.stderr and r.stdout == "", (args, r.stdout)
