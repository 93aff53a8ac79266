"""Cases for Part 1: wrong answers a learner might write (exercise, label, what the check
must say, code), and lines the notebook must print from its own runs."""

MISTAKES = [
    ("1", "k and v as wide as q", "you counted k_proj and v_proj as h x h", '''
    def count_params_llama(cfg):
        h, L, v, f = cfg.hidden, cfg.layers, cfg.vocab_size, cfg.ffn_hidden
        embeddings = v * h * (1 if cfg.tie_embeddings else 2)
        return embeddings + L * (4 * h * h + 3 * h * f + 2 * h) + h
    '''),
    ("1", "two MLP matrices", "SwiGLU has three h x f matrices", '''
    def count_params_llama(cfg):
        h, L, v, f = cfg.hidden, cfg.layers, cfg.vocab_size, cfg.ffn_hidden
        kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
        embeddings = v * h * (1 if cfg.tie_embeddings else 2)
        return embeddings + L * (2 * h * h + 2 * h * kv + 2 * h * f + 2 * h) + h
    '''),
    ("1", "embedding counted once", "this model has its own output head", '''
    def count_params_llama(cfg):
        h, L, v, f = cfg.hidden, cfg.layers, cfg.vocab_size, cfg.ffn_hidden
        kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
        return v * h + L * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + h
    '''),
    ("1", "norms left out", "the RMSNorm weights are missing", '''
    def count_params_llama(cfg):
        h, L, v, f = cfg.hidden, cfg.layers, cfg.vocab_size, cfg.ffn_hidden
        kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
        embeddings = v * h * (1 if cfg.tie_embeddings else 2)
        return embeddings + L * (2 * h * h + 2 * h * kv + 3 * h * f)
    '''),
    ("1", "the playbook's GPT formula", "the playbook's GPT formula", '''
    def count_params_llama(cfg):
        h, L, v = cfg.hidden, cfg.layers, cfg.vocab_size
        return h * v + L * (12 * h * h + 13 * h) + 2 * h
    '''),
    ("1", "a term left as NaN", "a NaN or an infinity in your count for tiny", '''
    import math

    def count_params_llama(cfg):
        h, L, v, f = cfg.hidden, cfg.layers, cfg.vocab_size, cfg.ffn_hidden
        kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
        norms = math.nan  # TODO: how many weights has an RMSNorm?
        embeddings = v * h * (1 if cfg.tie_embeddings else 2)
        return embeddings + L * (2 * h * h + 2 * h * kv + 3 * h * f + norms) + h
    '''),
    ("2", "forward only", "that is the forward pass only", '''
    def model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops):
        flops = 2 * count_params(cfg) + 4 * cfg.layers * cfg.hidden * seq_len
        return flops, tokens_per_s * flops / peak_flops
    '''),
    ("2", "no attention term", "add the attention term", '''
    def model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops):
        flops = 6 * count_params(cfg)
        return flops, tokens_per_s * flops / peak_flops
    '''),
    ("2", "non-embedding parameters", "embeddings included", '''
    def model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops):
        n = count_params(cfg) - cfg.vocab_size * cfg.hidden * (1 if cfg.tie_embeddings else 2)
        flops = 6 * n + 12 * cfg.layers * cfg.hidden * seq_len
        return flops, tokens_per_s * flops / peak_flops
    '''),
    ("2", "MFU as a percentage", "as a fraction", '''
    def model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops):
        flops = 6 * count_params(cfg) + 12 * cfg.layers * cfg.hidden * seq_len
        return flops, 100 * tokens_per_s * flops / peak_flops
    '''),
    ("2", "peak taken as TFLOP/s", "no TFLOP conversion", '''
    def model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops):
        flops = 6 * count_params(cfg) + 12 * cfg.layers * cfg.hidden * seq_len
        return flops, tokens_per_s * flops / 1e12 / peak_flops
    '''),
    ("2", "the attention term left as NaN", "a NaN or an infinity in (flops_per_token, mfu) for tiny", '''
    def model_flops_and_mfu(cfg, seq_len, tokens_per_s, peak_flops):
        attention = float("nan")  # TODO: QK^T and AV, forward and backward
        flops = 6 * count_params(cfg) + attention
        return flops, tokens_per_s * flops / peak_flops
    '''),
]

PRINTED = [
    "tiny model: 106,944 parameters",
    "fp32: params 4 + grads 4 + optim 8 = 16 bytes per parameter; activations 5.18 MiB for 8 x 64 tokens",
    "bf16: params 2 + grads 4 + optim 12 = 18 bytes per parameter",
    "llama3-8b (8.03B), fp32            : params 4 + grads 4 + optim 8 = 16 bytes/param = 120 GiB",
    "llama3-8b (8.03B), bf16            : params 2 + grads 2 + optim 12 = 16 bytes/param = 120 GiB",
    "llama3-8b (8.03B), bf16-fp32-grads : params 2 + grads 4 + optim 12 = 18 bytes/param = 135 GiB",
    "the runs above: 8 samples x 64 tokens = 512 tokens; the trainer counted 512 tokens per optimizer step",
    "h= 4096 L=32 v=131072: model 6,981,033,984  formula 6,981,033,984  equal: True",
    "weight matmuls (aten.mm): 541,056 = 6 x 90,176 parameters in matmuls: True",
    "attention (aten.bmm):     98,304 = 12 x L x h x s = 98,304: True",
]
