"""minGPT's GPT, as Karpathy's play_image notebook used it to model CIFAR-10 pixels.

An image becomes a sequence of colour-codebook indices in raster order (see data.py), and
the GPT predicts each pixel's token from the ones before it. That is the workload every
ZeRO stage in minizero is measured on, so the model is deliberately the plain one:

- Pre-LN blocks: x = x + attn(ln1(x)); x = x + mlp(ln2(x)).
- Separate `key`, `query`, `value`, `proj` Linear layers, as minGPT had them then (the
  attention itself is torch's fused scaled_dot_product_attention; the maths is identical).
- A learned position embedding that starts at zero, minGPT's weight init.

Two hooks exist for the rest of minizero:

- `GPT.checkpoint_fn`: when set (and training), each block runs as
  `checkpoint_fn(block, x)`. The model never imports a checkpointing library, so the same
  class trains under `minizero.checkpointing.checkpoint` and under
  `deepspeed.checkpointing.checkpoint`.
- `GPT.configure_param_groups`: minGPT's weight-decay split, in a fixed order, because
  ZeRO flattens and partitions each param group and every rank must agree on the layout.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# The config and presets live apart from the model so the command line can read them without torch.
from minizero.gpt.presets import PRESETS, GPTConfig, ModelConfigError, UnknownPresetError, get_preset  # noqa: F401


class SequenceTooLongError(ValueError):
    """forward() got more tokens than the model has position embeddings for."""


# ----------------------------------------------------------------------------- modules

class CausalSelfAttention(nn.Module):
    """Multi-head masked self-attention with an output projection."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.key = nn.Linear(config.n_embd, config.n_embd)
        self.query = nn.Linear(config.n_embd, config.n_embd)
        self.value = nn.Linear(config.n_embd, config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_drop = nn.Dropout(config.resid_pdrop)
        self.n_head = config.n_head
        self.attn_pdrop = config.attn_pdrop

    def forward(self, x):
        B, T, C = x.size()
        # (B, T, C) -> (B, nh, T, hs)
        k = self.key(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = self.query(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.value(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        # The fused kernel = softmax(q k^T / sqrt(hs) + causal mask) with dropout, times v.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.attn_pdrop if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """A pre-LN transformer block: the unit activation checkpointing recomputes."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd),
            nn.Dropout(config.resid_pdrop),
        )

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    """The full language model, with a context size of block_size."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Parameter(torch.zeros(1, config.block_size, config.n_embd))
        self.drop = nn.Dropout(config.embd_pdrop)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.block_size = config.block_size
        # Activation checkpointing hook: a callable (block, x) -> block(x) that may drop
        # the block's activations and recompute them in backward. None = keep them.
        self.checkpoint_fn = None
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.LayerNorm):
            module.bias.data.zero_()
            module.weight.data.fill_(1.0)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def configure_param_groups(self, weight_decay: float) -> list[dict]:
        """minGPT's split: Linear weights decay; biases, LayerNorm/Embedding weights and
        pos_emb do not. Params are listed in named_parameters() order, so every rank (and
        the DeepSpeed reference) builds the same flat buffers from the same model."""
        decay, no_decay = set(), set()
        for mn, m in self.named_modules():
            for pn, _ in m.named_parameters(recurse=False):
                fpn = f"{mn}.{pn}" if mn else pn
                if pn.endswith("bias"):
                    no_decay.add(fpn)
                elif pn.endswith("weight") and isinstance(m, nn.Linear):
                    decay.add(fpn)
                elif pn.endswith("weight") and isinstance(m, (nn.LayerNorm, nn.Embedding)):
                    no_decay.add(fpn)
        no_decay.add("pos_emb")

        params = dict(self.named_parameters())
        inter, union = decay & no_decay, decay | no_decay
        assert not inter, f"parameters {inter} made it into both decay and no_decay sets"
        assert not params.keys() - union, \
            f"parameters {params.keys() - union} were not separated into either decay or no_decay set"
        return [
            {"params": [p for n, p in params.items() if n in decay], "weight_decay": weight_decay},
            {"params": [p for n, p in params.items() if n in no_decay], "weight_decay": 0.0},
        ]

    def forward(self, idx, targets=None):
        b, t = idx.size()
        if t > self.block_size:
            raise SequenceTooLongError(f"sequence of {t} tokens is longer than block_size {self.block_size}: "
                                       f"crop it or build the model with block_size >= {t}")
        x = self.drop(self.tok_emb(idx) + self.pos_emb[:, :t, :])
        for block in self.blocks:
            x = self.checkpoint_fn(block, x) if self.checkpoint_fn is not None and self.training else block(x)
        logits = self.head(self.ln_f(x))

        loss = None
        if targets is not None:
            # Cross-entropy in fp32 whatever the compute dtype: the log-softmax over the
            # vocabulary is where bf16/fp16 lose the most precision, and doing it in fp32
            # makes fp32, bf16 and fp16 runs' losses comparable on one plot.
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss


# ----------------------------------------------------------------------------- sampling

@torch.no_grad()
def sample(model, x, steps, temperature=1.0, top_k=None):
    """Extend each row of x (B, t) by `steps` sampled tokens, feeding predictions back in.

    As minGPT: the context is cropped to the last block_size tokens, logits are divided by
    temperature, optionally restricted to the top_k most likely, and the next token is
    drawn from the softmax. The model is put in eval mode (no dropout) while sampling and
    returned to its previous mode afterwards.
    """
    block_size = model.block_size if hasattr(model, "block_size") else model.module.block_size
    was_training = model.training
    model.eval()
    try:
        for _ in range(steps):
            x_cond = x if x.size(1) <= block_size else x[:, -block_size:]
            logits, _ = model(x_cond)
            logits = logits[:, -1, :].float() / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits.masked_fill_(logits < v[:, [-1]], -math.inf)   # a mask, not a boolean index: no host sync
            probs = F.softmax(logits, dim=-1)
            ix = torch.multinomial(probs, num_samples=1)
            x = torch.cat((x, ix), dim=1)
    finally:
        model.train(was_training)
    return x
