"""The runtime around the ZeRO core: config, LR schedules, process groups, errors, launching ranks."""
