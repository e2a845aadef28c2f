"""`zero_optimization`: the ZeRO stage, buckets, ZeRO-3's knobs, and ZeRO-Offload's two
sub-sections, parsed as DeepSpeed 0.19.8's DeepSpeedZeroConfig (runtime/zero/config.py,
runtime/zero/offload_config.py), with its aliases and deprecated spellings.

One table per section, as in __init__.py (which builds the whole config and re-exports these
names). `acts=False` marks the knobs minizero accepts and does nothing with: they tune
DeepSpeed's own buffers, copies and CPU Adam; `ignored_knobs` lists those a config sets.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .schema import ConfigError, Section, boolean, integer, key, number, only, optional


def _offload_device(v, path):
    dev = "none" if v is None else v
    if dev not in ("none", "cpu", "nvme"):
        raise ConfigError(f"{path} must be \"none\", \"cpu\" or \"nvme\", got {dev!r}")
    return dev


def _nvme_path(v, path):
    if v is not None and (not isinstance(v, str) or not v):
        raise ConfigError(f"{path} must be a folder's path (a string), got {v!r}")
    return v


def _needs_nvme_path(section, path):
    """device "nvme" without a folder to swap to: one line (DeepSpeed asserts it deep inside)."""
    if section.device == "nvme" and section.nvme_path is None:
        raise ConfigError(f"{path}.device = \"nvme\" needs {path}.nvme_path, a folder on a fast local "
                          f"disk for the swap files")


def _fraction(v, path):
    """A number in [0, 1] (DeepSpeed: Field(ge=0.0, le=1.0))."""
    v = number(lo=0)(v, path)
    if v > 1:
        raise ConfigError(f"{path} must be between 0 and 1, got {v!r}")
    return v


@dataclass
class OffloadOptimizerConfig(Section):
    """`zero_optimization.offload_optimizer` (ZeRO-Offload; minizero/offload/host.py), with
    DeepSpeed 0.19.8's defaults (DeepSpeedZeroOffloadOptimizerConfig, runtime/zero/offload_config.py).
    acts=False: DeepSpeed's tuning of its own CPU Adam and NVMe swapper (minizero/offload/nvme.py
    swaps the whole optimizer shard in for the step, reads issued when the step starts, and
    always lets the writes finish during the next forward and backward)."""
    device: str = key("none", _offload_device)            # "nvme": minizero/offload/nvme.py
    pin_memory: bool = key(True, boolean)                 # pinned host buffers when the device is a GPU
    nvme_path: Optional[str] = key(None, _nvme_path)      # the swap files' folder (device "nvme")
    buffer_count: int = key(4, integer(lo=0), acts=False)
    pipeline_read: bool = key(False, boolean, acts=False)
    pipeline_write: bool = key(False, boolean, acts=False)
    fast_init: bool = key(False, boolean, acts=False)
    ratio: float = key(1.0, _fraction, acts=False)        # stage 3: the fraction of sub-groups offloaded
    super_offload: bool = key(False, boolean, acts=False)
    cpuadam_cores_perc: float = key(0.8, _fraction, acts=False)

    def __post_init__(self):
        _needs_nvme_path(self, "zero_optimization.offload_optimizer")

    @property
    def enabled(self) -> bool:
        """In host memory (cpu), or swapped between host memory and files (nvme)."""
        return self.device in ("cpu", "nvme")


@dataclass
class OffloadParamConfig(Section):
    """`zero_optimization.offload_param` (ZeRO-Infinity, stage 3 only), with DeepSpeed
    0.19.8's defaults (DeepSpeedZeroOffloadParamConfig). With "nvme", buffer_count is how
    many parameter shards minizero reads ahead of their gather (offload/nvme.py). acts=False: the
    size of DeepSpeed's swap buffers and of its CPU parameter cache (minizero keeps no cache:
    a shard is in host memory from its read to its gather)."""
    device: str = key("none", _offload_device)            # "nvme": minizero/offload/nvme.py
    pin_memory: bool = key(True, boolean)
    nvme_path: Optional[str] = key(None, _nvme_path)
    buffer_count: int = key(5, integer(lo=0))             # nvme: shards read ahead of use
    buffer_size: int = key(100_000_000, integer(lo=0), acts=False)
    max_in_cpu: int = key(1_000_000_000, integer(lo=0), acts=False)

    def __post_init__(self):
        _needs_nvme_path(self, "zero_optimization.offload_param")

    @property
    def enabled(self) -> bool:
        return self.device in ("cpu", "nvme")


OffloadConfig = OffloadOptimizerConfig   # the name earlier versions exported


def _stage(v, path):
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 3:
        raise ConfigError(f"{path} must be 0, 1, 2 or 3 (ZeRO stage), got {v!r}")
    return v


@dataclass
class ZeroConfig(Section):
    """`zero_optimization`, as DeepSpeedZeroConfig (runtime/zero/config.py), whose pydantic
    aliases (populate_by_name=True) are the `alias`es here.

    acts=False: knobs that tune DeepSpeed's own buffers and copies (contiguous gradients,
    allgather buckets, sub-groups, offload buffers), not *what* ZeRO computes nor when
    minizero communicates.
    """
    stage: int = key(0, _stage)
    reduce_bucket_size: int = key(500_000_000, integer(lo=1))
    stage3_param_persistence_threshold: int = key(100_000, integer(lo=0), alias="param_persistence_threshold")
    offload_optimizer: Optional[OffloadOptimizerConfig] = key(None, optional(OffloadOptimizerConfig.parse))
    offload_param: Optional[OffloadParamConfig] = key(None, optional(OffloadParamConfig.parse))
    # when minizero moves data: asynchronous bucket reductions (buckets.py), ZeRO-3's
    # prefetch, reuse and live limit (prefetch.py)
    overlap_comm: Optional[bool] = key(None, optional(boolean))   # None: True only at stage 3
    stage3_prefetch_bucket_size: int = key(50_000_000, integer(lo=0), alias="prefetch_bucket_size")
    stage3_max_live_parameters: int = key(1_000_000_000, integer(lo=0), alias="max_live_parameters")
    stage3_max_reuse_distance: int = key(1_000_000_000, integer(lo=0), alias="max_reuse_distance")
    # ZeRO-3 that knows where the nodes are (sharding.py). hpZ, ZeRO++'s hierarchical
    # partitioning (DeepSpeed's key): a second shard of the parameters over k consecutive ranks,
    # which backward gathers from. HSDP (minizero's own key; PyTorch's HSDP, MiCS in DeepSpeed
    # before 0.19.8): shard over S consecutive ranks, replicate across the N/S such groups.
    zero_hpz_partition_size: int = key(1, integer(lo=1))
    hsdp_shard_size: int = key(0, integer(lo=0))             # 0: one shard group of all ranks
    # MiCS's keys: removed in DeepSpeed 0.19.8 (they raise there); read as hsdp_shard_size, with a line
    mics_shard_size: int = key(-1, integer(lo=-1))
    mics_hierarchical_params_gather: bool = key(False, boolean, acts=False)
    # accepted, minizero does nothing with them
    contiguous_gradients: bool = key(True, boolean, acts=False)
    reduce_scatter: bool = key(True, boolean, acts=False)
    allgather_bucket_size: int = key(500_000_000, integer(lo=1), acts=False)
    sub_group_size: int = key(1_000_000_000, integer(lo=0), acts=False)
    # minizero's ZeRO-3 never swaps F.linear: docs/deepspeed.md, "ZeRO-3 replaces F.linear
    # (memory_efficient_linear)"
    memory_efficient_linear: bool = key(True, boolean, acts=False)
    use_multi_rank_bucket_allreduce: bool = key(True, boolean, acts=False)
    # accepted only at the value that is what minizero always does
    allgather_partitions: bool = key(True, only(True, "parameters are always all-gathered"))
    load_from_fp32_weights: bool = key(True, only(True, "checkpoints always restore the fp32 master"))
    ignore_unused_parameters: bool = key(True, only(True, "unused parameters get a zero gradient"))
    round_robin_gradients: bool = key(False, boolean, acts=False)   # DeepSpeed's offload copy ordering
    # deprecated; DeepSpeed accepts it and does nothing with it (pin_memory in each offload section)
    cpu_offload_use_pin_memory: Optional[bool] = key(None, optional(boolean), acts=False)
    elastic_checkpoint: bool = key(False, only(False, "minizero reshards any checkpoint as it loads: docs/checkpoints.md"))
    stage3_gather_16bit_weights_on_model_save: bool = key(
        False, only(False, "there is no save_16bit_model"), alias="gather_16bit_weights_on_model_save")

    def __post_init__(self):
        # DeepSpeed's default (DeepSpeedZeroConfig.overlap_comm_valid): on at stage 3 only
        if self.overlap_comm is None:
            self.overlap_comm = self.stage == 3
        if self.offload_param_enabled and self.stage != 3:
            raise ConfigError(f"zero_optimization.offload_param needs stage 3 (only ZeRO-3 partitions the "
                              f"parameters; DeepSpeed silently ignores it at stage {self.stage}): set "
                              f"\"stage\": 3 or remove offload_param")
        if self.offload_optimizer_enabled and self.stage == 0:
            raise ConfigError("zero_optimization.offload_optimizer needs stage 1, 2 or 3 (it moves this rank's "
                              "optimizer shard to the CPU): set \"stage\" or remove offload_optimizer")
        if self.mics_shard_size > 0:
            if "hsdp_shard_size" in self.given:
                raise ConfigError("zero_optimization.mics_shard_size and hsdp_shard_size are two spellings of one "
                                  "setting; keep only hsdp_shard_size")
            self.hsdp_shard_size = self.mics_shard_size
        for k, v in (("zero_hpz_partition_size", self.zero_hpz_partition_size > 1),
                     ("hsdp_shard_size", self.hsdp_shard_size > 0)):
            if v and self.stage != 3:
                raise ConfigError(f"zero_optimization.{k} needs stage 3 (it partitions the parameters over part of "
                                  f"the ranks): set \"stage\": 3 or remove {k}")
        if self.zero_hpz_partition_size > 1 and self.hsdp_shard_size > 0:
            raise ConfigError("zero_optimization: zero_hpz_partition_size and hsdp_shard_size are two answers to one "
                              "question (keep parameter gathers inside a node); set one of them")
        if self.offload_optimizer is not None and self.offload_optimizer.ratio != 1.0 and self.stage != 3:
            raise ConfigError(f"zero_optimization.offload_optimizer.ratio = {self.offload_optimizer.ratio}: "
                              f"partial offload is a stage-3 option (as in DeepSpeed); remove it")

    @property
    def offload_optimizer_enabled(self) -> bool:
        return self.offload_optimizer is not None and self.offload_optimizer.enabled

    @property
    def offload_param_enabled(self) -> bool:
        return self.offload_param is not None and self.offload_param.enabled


_DEPRECATED_OFFLOAD = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}


def _zero(v, path) -> ZeroConfig:
    if isinstance(v, bool):
        # DS's deprecated form (zero/config.py: read_zero_config_deprecated): true = stage 1.
        v = {"stage": 1 if v else 0}
    if isinstance(v, dict) and any(k in v for k in _DEPRECATED_OFFLOAD):
        # DS's deprecated booleans (DeepSpeedZeroConfig: `new_param_fn`): true = {"device": "cpu"}
        v = dict(v)
        for old, new in _DEPRECATED_OFFLOAD.items():
            if old in v:
                if new in v:
                    raise ConfigError(f"'{path}.{old}' and '{path}.{new}' are two spellings of one key; keep only '{new}'")
                flag = boolean(v.pop(old), f"{path}.{old}")
                v[new] = {"device": "cpu"} if flag else None
    return ZeroConfig.parse(v, path)


@dataclass
class AioConfig(Section):
    """`aio`, the top-level section of DeepSpeed's NVMe swapper (runtime/swap_tensor/aio_config.py,
    DeepSpeed 0.19.8's defaults). minizero's swapper (offload/nvme.py) reads and writes with plain
    file I/O in threads: `intra_op_parallelism` is how many (DeepSpeed's earlier name,
    `thread_count`, is its alias) and `block_size` the bytes of one read or write call.
    acts=False: libaio's queue and submission knobs, which plain file I/O does not have."""
    block_size: int = key(1_048_576, integer(lo=1))
    intra_op_parallelism: int = key(1, integer(lo=1), alias="thread_count")
    queue_depth: int = key(8, integer(lo=1), acts=False)
    single_submit: bool = key(False, boolean, acts=False)
    overlap_events: bool = key(True, boolean, acts=False)
    use_gds: bool = key(False, only(False, "GPUDirect Storage needs CUDA and DeepSpeed's GDS op"))


def ignored_knobs(cfg) -> list[str]:
    """The zero_optimization keys `cfg` sets (as it spells them) that minizero accepts for
    DeepSpeed compatibility but does nothing with (acts=False), offload sub-keys as
    `offload_optimizer.buffer_count`."""
    out = [k for k in cfg.zero.given if not ZeroConfig.rows()[k].metadata["acts"]]
    for name in ("offload_optimizer", "offload_param"):
        sub = getattr(cfg.zero, name)
        if sub is not None:
            rows = type(sub).rows()
            out += [f"{name}.{k}" for k in sub.given if not rows[k].metadata["acts"]]
    aio = getattr(cfg, "aio", None)
    if aio is not None:
        out += [f"aio.{k}" for k in aio.given if not AioConfig.rows()[k].metadata["acts"]]
    return out


def renamed_keys_note(cfg) -> str | None:
    """The line the engine logs when the config spells a setting by a removed DeepSpeed name."""
    if "mics_shard_size" not in cfg.zero.given or cfg.zero.mics_shard_size <= 0:
        return None
    return (f"zero_optimization.mics_shard_size = {cfg.zero.mics_shard_size}: MiCS is removed from DeepSpeed "
            f"0.19.8 (the key raises there); minizero reads it as hsdp_shard_size, its key for the same "
            f"sharding: write that")


def check_world_size(zero: ZeroConfig, world_size: int) -> None:
    """What the zero section asks of the world size: its shard groups must divide it."""
    for k, size in (("zero_hpz_partition_size", zero.zero_hpz_partition_size), ("hsdp_shard_size", zero.hsdp_shard_size)):
        if size > 1 and world_size % size:
            raise ConfigError(f"zero_optimization.{k} = {size} does not divide the {world_size} ranks into groups: "
                              f"use a divisor of the world size (the ranks of one node, usually)")


def ignored_knobs_note(cfg) -> str | None:
    """The one line the engine logs about `ignored_knobs(cfg)`; None when there are none."""
    knobs = ignored_knobs(cfg)
    if not knobs:
        return None
    zero = [k for k in knobs if not k.startswith("aio.")]
    named = ", ".join(([f"zero_optimization {', '.join(zero)}"] if zero else []) + [k for k in knobs if k not in zero])
    return (f"{named}: accepted for DeepSpeed compatibility; they tune "
            f"DeepSpeed's own buffers, copies, CPU Adam and libaio, which minizero does not have (docs/zero.md)")
