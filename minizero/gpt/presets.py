"""The GPT's configuration and its named presets, and the datasets a run can train on: the
choices the command line offers, apart from the model and the data so that the command
line is checked before torch is imported (train_args.py; model.py and data.py re-export
them). No torch here.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

# The datasets minizero.data builds (data.build_datasets).
DATASETS = ("cifar10", "synthetic")


class ModelConfigError(ValueError):
    """A GPTConfig that cannot build a model (e.g. n_embd not divisible by n_head)."""


class UnknownPresetError(ValueError):
    """get_preset() was given a name that is not in PRESETS."""


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    embd_pdrop: float = 0.1
    resid_pdrop: float = 0.1
    attn_pdrop: float = 0.1

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if int(getattr(self, name)) < 1:
                raise ModelConfigError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise ModelConfigError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}): "
                                   f"pick an n_head that divides it")


# ----------------------------------------------------------------------------- presets
# "tiny" and "micro" have an *odd* parameter count, so the flat parameter buffer never
# splits evenly over 2 or 4 ranks and ZeRO's padding code is always exercised. With an odd
# n_embd E the decay group is 12*E^2*L + E*V (L blocks, V vocab), which is a multiple of 4
# whenever V is; so their vocab is 62 (not 64): the decay group is then 2 mod 4 and the
# no-decay group odd. Use ncluster=62 with them (vocab_size must equal ncluster).

PRESETS: dict[str, GPTConfig] = {
    # The minGPT play_image tutorial's model; it logs "number of parameters: 1.000166e+07".
    # Its dropouts are GPTConfig's default 0.1 (minGPT's), not the 0.0 the DeepSpeed
    # tutorial's GPTConfig sets: kept, so existing runs and numbers stay as they were.
    "tutorial": GPTConfig(vocab_size=512, block_size=32 * 32 - 1, n_layer=12, n_head=8, n_embd=256),
    # The DeepSpeed tutorial's step 5 (ZeRO-3 + offload, launch/ds_config_step5.json): the
    # same GPT scaled to 24 layers, with its GPTConfig's dropouts of 0.0; 19,478,784 params.
    "tutorial-24": GPTConfig(vocab_size=512, block_size=32 * 32 - 1, n_layer=24, n_head=8, n_embd=256,
                             embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0),
    # iGPT-S-like width/depth: ~76.7M params, where model states (params, grads, Adam
    # moments) rather than activations dominate memory, i.e. where ZeRO pays off.
    "igpt-s": GPTConfig(vocab_size=512, block_size=32 * 32 - 1, n_layer=24, n_head=8, n_embd=512),
    # Tests / fast CPU runs on 8x8 images: 108,801 params (decay 99,162, no-decay 9,639).
    "tiny": GPTConfig(vocab_size=62, block_size=8 * 8 - 1, n_layer=2, n_head=3, n_embd=63),
    # Fastest tests, 8x8 images: 15,099 params (decay 11,886, no-decay 3,213).
    "micro": GPTConfig(vocab_size=62, block_size=8 * 8 - 1, n_layer=2, n_head=3, n_embd=21),
}


def get_preset(name: str, **overrides) -> GPTConfig:
    """A fresh copy of a named config, with any field overridden (e.g. block_size=255)."""
    if name not in PRESETS:
        raise UnknownPresetError(f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}")
    try:
        return replace(PRESETS[name], **overrides)
    except TypeError:
        bad = sorted(set(overrides) - set(GPTConfig.__dataclass_fields__))
        raise ModelConfigError(f"unknown GPTConfig field(s) {bad}: valid fields are "
                               f"{', '.join(GPTConfig.__dataclass_fields__)}") from None
