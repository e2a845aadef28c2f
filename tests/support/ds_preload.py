"""Imported once by the test forkserver so every forked rank starts with DeepSpeed loaded,
and without the shared-memory inference op DeepSpeed would otherwise compile on its first
CPU run (a minute; training never calls it: reference/ds_run.py's skip_inference_shm_op).

DS_ACCELERATOR=cpu must be set before the first import of deepspeed."""
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402,F401

# deepspeed.initialize imports this on every run (runtime/zero/utils.py,
# is_zero_supported_optimizer, checks for Muon), and its @compiler.compile() decorators import
# torch._inductor: 1.8 of a 2.0 s DeepSpeed run (cProfile of rank 0, ZeRO-2 bf16 offload, tiny
# GPT, 2 steps), in every rank of every DeepSpeed launch. Imported here, once per test session.
# It starts no thread (checked: threading.enumerate() is the main thread alone after it), so
# forking after it is as safe as after torch.
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: E402,F401

# deepspeed.initialize imports these too (runtime/config.py's expert-parallel config and
# engine.py's _configure_expert_parallel), 1.2 s of rank time over the suite (py-spy).
import deepspeed.module_inject.auto_ep_config  # noqa: E402,F401
import deepspeed.module_inject.auto_ep_layer  # noqa: E402,F401

from reference.ds_run import skip_inference_shm_op  # noqa: E402

skip_inference_shm_op()

# DeepSpeed's CPU accelerator answers device_count() by running `numactl --hardware` each time
# (utils/numa.py, get_numa_cores), and ZeRO-3 asks it in every reduce-scatter of gradients
# (stage3.py, __avg_scatter_grads): 140 subprocesses per rank in a 20-step ZeRO-3 run of the
# agreement tests, each a fork of a process holding torch and DeepSpeed (sys.modules'
# subprocess.Popen counted per call site). The machine's NUMA layout does not change while the
# tests run: asked once per process, the same answer.
import functools  # noqa: E402

import deepspeed.utils.numa as _numa  # noqa: E402

_numa.get_numa_cores = functools.lru_cache(maxsize=None)(_numa.get_numa_cores)
