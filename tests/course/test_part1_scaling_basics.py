"""Part 1's answers: the parameter count of the Llama-style model from its shape, and training FLOPs per
token and MFU of a measured run (both in one process)."""

from answers import (  # noqa: F401 - collected here, with this part's WRONG and RIGHT (conftest.py)
    test_a_wrong_answer_is_rejected_naming_its_mistake, test_an_unusual_right_answer_passes)

PART = 1

WRONG = [  # (exercise, label, what the check must say, answer source)
    (1, "k and v as wide as q", "you counted k_proj and v_proj as h x h", '''
def count_params_llama(cfg):
    h, L, v, f = cfg.hidden, cfg.layers, cfg.vocab_size, cfg.ffn_hidden
    embeddings = v * h * (1 if cfg.tie_embeddings else 2)
    return embeddings + L * (4 * h * h + 3 * h * f + 2 * h) + h
'''),
    (1, "k and v h x kv_heads", "you took k_proj and v_proj as h x kv_heads", '''
def count_params_llama(cfg):
    h, L, v, f = cfg.hidden, cfg.layers, cfg.vocab_size, cfg.ffn_hidden
    kv = cfg.kv_heads   # width of k_proj and v_proj
    embeddings = v * h * (1 if cfg.tie_embeddings else 2)
    return embeddings + L * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + h
'''),
    (1, "two MLP matrices", "SwiGLU has three h x f matrices", '''
def count_params_llama(cfg):
    h, L, v, f = cfg.hidden, cfg.layers, cfg.vocab_size, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    embeddings = v * h * (1 if cfg.tie_embeddings else 2)
    return embeddings + L * (2 * h * h + 2 * h * kv + 2 * h * f + 2 * h) + h
'''),
    (1, "an MLP 4h wide", "you took the MLP as 4h wide", '''
def count_params_llama(cfg):
    h, L, v = cfg.hidden, cfg.layers, cfg.vocab_size
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    f = 4 * h   # the MLP's width
    embeddings = v * h * (1 if cfg.tie_embeddings else 2)
    return embeddings + L * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + h
'''),
    (1, "embedding counted once", "this model has its own output head", '''
def count_params_llama(cfg):
    h, L, v, f = cfg.hidden, cfg.layers, cfg.vocab_size, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    return v * h + L * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + h
'''),
    (1, "a tied head counted again", "the output head is the embedding matrix itself", '''
def count_params_llama(cfg):
    h, L, v, f = cfg.hidden, cfg.layers, cfg.vocab_size, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    return 2 * v * h + L * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + h
'''),
    (1, "norms left out", "the RMSNorm weights are missing", '''
def count_params_llama(cfg):
    h, L, v, f = cfg.hidden, cfg.layers, cfg.vocab_size, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    embeddings = v * h * (1 if cfg.tie_embeddings else 2)
    return embeddings + L * (2 * h * h + 2 * h * kv + 3 * h * f)
'''),
    (1, "one norm per block", "each block has two RMSNorms", '''
def count_params_llama(cfg):
    h, L, v, f = cfg.hidden, cfg.layers, cfg.vocab_size, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    embeddings = v * h * (1 if cfg.tie_embeddings else 2)
    return embeddings + L * (2 * h * h + 2 * h * kv + 3 * h * f + h) + h
'''),
    (1, "the final norm left out", "the final norm (h =", '''
def count_params_llama(cfg):
    h, L, v, f = cfg.hidden, cfg.layers, cfg.vocab_size, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    embeddings = v * h * (1 if cfg.tie_embeddings else 2)
    return embeddings + L * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h)
'''),
    (1, "biases counted", "you counted biases", '''
def count_params_llama(cfg):
    h, L, v, f = cfg.hidden, cfg.layers, cfg.vocab_size, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    attention = (h * h + h) + 2 * (h * kv + kv) + (h * h + h)   # q, k, v, o with their biases
    mlp = 2 * (h * f + f) + (f * h + h)                         # gate, up, down with their biases
    embeddings = v * h * (1 if cfg.tie_embeddings else 2)
    return embeddings + L * (attention + mlp + 2 * h) + h
'''),
    (1, "one block too few", "one block too few", '''
def count_params_llama(cfg):
    h, L, v, f = cfg.hidden, cfg.layers, cfg.vocab_size, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    total = v * h * (1 if cfg.tie_embeddings else 2) + h
    for layer in range(1, L):   # layers 1 .. L-1
        total += 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    return total
'''),
    (1, "the playbook's GPT formula", "the playbook's GPT formula", '''
def count_params_llama(cfg):
    h, L, v = cfg.hidden, cfg.layers, cfg.vocab_size
    return h * v + L * (12 * h * h + 13 * h) + 2 * h
'''),
    (1, "asks the engine's count", "asks the engine for the answer (count_params)", '''
def count_params_llama(cfg):
    return count_params(cfg)
'''),
    (1, "counts the notebook's model", "asks the engine for the answer (Transformer)", '''
def count_params_llama(cfg):
    return numel(cfg)   # the model built on the meta device, above
'''),
    (1, "a term left as NaN", "a NaN or an infinity in your count for tiny", '''
import math

def count_params_llama(cfg):
    h, L, v, f = cfg.hidden, cfg.layers, cfg.vocab_size, cfg.ffn_hidden
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    norms = math.nan  # TODO: how many weights has an RMSNorm?
    embeddings = v * h * (1 if cfg.tie_embeddings else 2)
    return embeddings + L * (2 * h * h + 2 * h * kv + 3 * h * f + norms) + h
'''),

    (2, "forward only", "that is the forward pass only", '''
def model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops):
    flops = 2 * count_params(cfg) + 4 * cfg.layers * cfg.hidden * seq_len
    return flops, tokens_per_s * flops / peak_flops
'''),
    (2, "no attention term", "add the attention term", '''
def model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops):
    flops = 6 * count_params(cfg)
    return flops, tokens_per_s * flops / peak_flops
'''),
    (2, "the attention term halved", "your attention term is 6·L·h·s", '''
def model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops):
    flops = 6 * count_params(cfg) + 6 * cfg.layers * cfg.hidden * seq_len   # 6 per parameter, 6 for attention
    return flops, tokens_per_s * flops / peak_flops
'''),
    (2, "attention of the whole sequence", "your attention term is 12·L·h·s²", '''
def model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops):
    flops = 6 * count_params(cfg) + 12 * cfg.layers * cfg.hidden * seq_len ** 2   # QK^T is s x s
    return flops, tokens_per_s * flops / peak_flops
'''),
    (2, "the model's max_seq_len", "your attention term uses cfg.max_seq_len", '''
def model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops):
    flops = 6 * count_params(cfg) + 12 * cfg.layers * cfg.hidden * cfg.max_seq_len
    return flops, tokens_per_s * flops / peak_flops
'''),
    (2, "per sequence", "that is per sequence of", '''
def model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops):
    per_token = 6 * count_params(cfg) + 12 * cfg.layers * cfg.hidden * seq_len
    flops = per_token * seq_len   # one sequence
    return flops, tokens_per_s * per_token / peak_flops
'''),
    (2, "non-embedding parameters", "embeddings included", '''
def model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops):
    n = count_params(cfg) - cfg.vocab_size * cfg.hidden * (1 if cfg.tie_embeddings else 2)
    flops = 6 * n + 12 * cfg.layers * cfg.hidden * seq_len
    return flops, tokens_per_s * flops / peak_flops
'''),
    (2, "MFU as a percentage", "as a fraction", '''
def model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops):
    flops = 6 * count_params(cfg) + 12 * cfg.layers * cfg.hidden * seq_len
    return flops, 100 * tokens_per_s * flops / peak_flops
'''),
    (2, "peak taken as TFLOP/s", "no TFLOP conversion", '''
def model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops):
    flops = 6 * count_params(cfg) + 12 * cfg.layers * cfg.hidden * seq_len
    return flops, tokens_per_s * flops / 1e12 / peak_flops
'''),
    (2, "peak over achieved", "MFU is achieved over peak", '''
def model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops):
    flops = 6 * count_params(cfg) + 12 * cfg.layers * cfg.hidden * seq_len
    return flops, peak_flops / (tokens_per_s * flops)
'''),
    (2, "the MFU of 6N alone", "compute the MFU from the same flops_per_token you return", '''
def model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops):
    N = count_params(cfg)
    flops_per_token = 6 * N + 12 * cfg.layers * cfg.hidden * seq_len
    return flops_per_token, tokens_per_s * 6 * N / peak_flops
'''),
    (2, "the attention term left as NaN", "a NaN or an infinity in (flops_per_token, mfu) for tiny", '''
def model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops):
    attention = float("nan")  # TODO: QK^T and AV, forward and backward
    flops = 6 * count_params(cfg) + attention
    return flops, tokens_per_s * flops / peak_flops
'''),
]

RIGHT = [  # (exercise, label, answer source): unusual but right
    (1, "matrix by matrix, with head_dim from the config", '''
def count_params_llama(cfg):
    h, d = cfg.hidden, cfg.head_dim
    shapes = {"q_proj": (h, cfg.heads * d), "k_proj": (h, cfg.kv_heads * d), "v_proj": (h, cfg.kv_heads * d),
              "o_proj": (cfg.heads * d, h), "gate_proj": (h, cfg.ffn_hidden), "up_proj": (h, cfg.ffn_hidden),
              "down_proj": (cfg.ffn_hidden, h), "attn_norm": (h, 1), "mlp_norm": (h, 1)}
    block = sum(a * b for a, b in shapes.values())
    heads = 1 if cfg.tie_embeddings else 2
    return heads * cfg.vocab_size * h + cfg.layers * block + h
'''),
    (1, "k and v by the GQA ratio, as a float that is whole", '''
def count_params_llama(cfg):
    h, L, v, f = cfg.hidden, cfg.layers, cfg.vocab_size, cfg.ffn_hidden
    kv = h * cfg.kv_heads / cfg.heads   # k, v are kv_heads/heads as wide as q
    per_block = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    return float(v * h * (1 + (not cfg.tie_embeddings)) + L * per_block + h)
'''),

    (2, "three times the forward", '''
def model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops):
    forward = 2 * count_params(cfg) + 4 * cfg.layers * cfg.hidden * seq_len   # matmuls, then QK^T and AV
    flops_per_token = 3 * forward                                             # backward is twice the forward
    achieved = tokens_per_s * flops_per_token                                 # model FLOP/s
    return flops_per_token, achieved / peak_flops
'''),
    (2, "N counted on the model", '''
def model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops):
    N = numel(cfg)   # every parameter of the model built on the meta device: the same N
    flops_per_token = 6 * N + 12 * cfg.layers * cfg.hidden * seq_len
    return float(flops_per_token), float(tokens_per_s) * flops_per_token / float(peak_flops)
'''),
]
