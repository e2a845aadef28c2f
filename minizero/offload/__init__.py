"""Where model states live besides the device: host memory (ZeRO-Offload, host.py) and NVMe
files below it (ZeRO-Infinity's NVMe tier, nvme.py). The ZeRO core reaches them through a
FlatParam's storage (a parameter shard: HostShard) and the ShardedOptimizer's states (the
fp32 masters and Adam's moments: HostStates); `Offload`, read from the config, sets both up.
"""
from .host import HostShard, HostStates, Offload  # noqa: F401
