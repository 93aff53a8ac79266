"""Cases for Part 2: wrong answers a learner might write (exercise, label, what the check
must say, code), and lines the notebook must print from its own runs."""

MISTAKES = [
    ("1", "norms in the compute dtype", "computes in fp32 whatever the model's dtype", '''
    def block_activation_bytes(cfg, b, s, dtype_bytes):
        h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
        kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
        norm = dtype_bytes * 2 * h + 4
        return b * s * (2 * norm + dtype_bytes * (4 * h + 2 * kv + 4 * f) + 4 * a)
    '''),
    ("1", "no logsumexp", "the SDPA logsumexp is missing", '''
    def block_activation_bytes(cfg, b, s, dtype_bytes):
        h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
        kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
        return b * s * (2 * (8 * h + 4) + dtype_bytes * (4 * h + 2 * kv + 4 * f))
    '''),
    ("1", "the s x s scores counted", "keeps no s x s score matrix", '''
    def block_activation_bytes(cfg, b, s, dtype_bytes):
        h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
        kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
        return b * s * (2 * (8 * h + 4) + dtype_bytes * (4 * h + 2 * kv + 4 * f + a * s) + 4 * a)
    '''),
    ("1", "k and v as wide as q", "not h (grouped-query attention)", '''
    def block_activation_bytes(cfg, b, s, dtype_bytes):
        h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
        return b * s * (2 * (8 * h + 4) + dtype_bytes * (6 * h + 4 * f) + 4 * a)
    '''),
    ("1", "three SwiGLU tensors", "SwiGLU keeps four f-wide tensors", '''
    def block_activation_bytes(cfg, b, s, dtype_bytes):
        h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
        kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
        return b * s * (2 * (8 * h + 4) + dtype_bytes * (4 * h + 2 * kv + 3 * f) + 4 * a)
    '''),
    ("1", "the logsumexp left as NaN", "a NaN or an infinity in your bytes for tiny", '''
    def block_activation_bytes(cfg, b, s, dtype_bytes):
        h, a, f = cfg.hidden, cfg.heads, cfg.ffn_hidden
        kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
        lse = float("nan")  # TODO: what does flash attention keep per head?
        return b * s * (2 * (8 * h + 4) + dtype_bytes * (4 * h + 2 * kv + 4 * f) + lse)
    '''),
    ("2", "the whole block checkpointed", "that is full recomputation", '''
    def recompute_attention_core(model):
        for block in model.layers.values():
            plain = block.forward
            block.forward = lambda x, cos, sin, plain=plain: checkpoint(plain, x, cos, sin, use_reentrant=False)
    '''),
    ("2", "only the first block", "1 of 3 blocks recompute their attention core", '''
    def recompute_attention_core(model):
        core = model.layers["0"].attn.core_attention
        plain = core.forward
        core.forward = lambda q, k, v, plain=plain: checkpoint(plain, q, k, v, use_reentrant=False)
    '''),
    ("2", "forward under no_grad", "gets no gradient", '''
    def recompute_attention_core(model):
        for block in model.layers.values():
            core = block.attn.core_attention
            plain = core.forward

            def forward(q, k, v, plain=plain):
                with torch.no_grad():
                    return plain(q, k, v)
            core.forward = forward
    '''),
    ("2", "the wrapper built but never installed", "nothing was recomputed", '''
    def recompute_attention_core(model):
        for block in model.layers.values():
            core = block.attn.core_attention
            wrapped = lambda q, k, v, plain=core.forward: checkpoint(plain, q, k, v, use_reentrant=False)
    '''),
    ("2", "inputs detached", "gets no gradient", '''
    def recompute_attention_core(model):
        for block in model.layers.values():
            core = block.attn.core_attention
            plain = core.forward
            core.forward = lambda q, k, v, plain=plain: checkpoint(plain, q.detach(), k.detach(), v.detach(),
                                                                   use_reentrant=False)
    '''),
    ("2", "causal mask multiplied by -inf", "a NaN or an infinity in the loss of the model with your recomputation", '''
    def recompute_attention_core(model):
        def attention(q, k, v):
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
            scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
            causal = torch.ones(q.shape[2], q.shape[2]).tril()
            scores = scores * causal + (1 - causal) * float("-inf")  # 0 * -inf is NaN
            return scores.softmax(-1) @ v

        for block in model.layers.values():
            block.attn.core_attention.forward = lambda q, k, v: checkpoint(attention, q, k, v, use_reentrant=False)
    '''),
]

PRINTED = [
    "tiny: h=64, heads a=8, kv width=32, SwiGLU f=128, 2 blocks",
    "fp32: one block, b=2, s=16 keeps 140,544 bytes = 4,392 per token",
    "bf16: one block, b=2, s=16 keeps 87,296 bytes = 2,728 per token:",
    "b=4: s=64:  1.07 MiB (4392 B/token)   s=128:  2.14 MiB (4392 B/token)   s=256:  4.29 MiB (4392 B/token)",
    "each extra position adds 32 bytes per token = 4 bytes x 8 heads: one fp32 attention probability per head per key",
    "llama3-8b, one sequence of  4096: flash   26.7 GiB, eager   58.7 GiB",
    "llama3-8b, seq 4096, flash attention, --recompute full     : activations   1.2 GiB",
]
