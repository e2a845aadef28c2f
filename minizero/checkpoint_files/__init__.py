"""Model checkpoints: sharded save/resume of an engine (checkpoint_io, the folder, the state apart
from its layout), resharding, consolidation into one fp32 state dict, DeepSpeed's folders both ways."""
