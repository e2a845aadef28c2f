import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tests import `tests.launcher`; make the repository root importable.
sys.path.insert(0, ROOT)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# DeepSpeed JIT-compiles a small C++ op (deepspeed_shm_comm) on its first CPU run and
# caches it by source path. Keep the cache per checkout: two clones sharing
# ~/.cache/torch_extensions would rebuild it back and forth (a minute each time).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".torch_extensions"))
