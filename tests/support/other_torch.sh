#!/usr/bin/env bash
# Run the tests under another torch than the checkout's own: pyproject.toml promises a range
# of torch versions, and this is how a version in it is checked.
#
#   bash tests/support/other_torch.sh 2.11.0            # the version-sensitive tests (below)
#   bash tests/support/other_torch.sh 2.11.0 --all      # the whole CPU suite
#   bash tests/support/other_torch.sh 2.11.0 -x --durations 20          # pytest options added
#   bash tests/support/other_torch.sh 2.11.0 tests/core/test_engine.py -k stage3   # your pick
#
# The first run of a version makes a virtual environment for it, outside the checkout, in
# $MINIZERO_TORCH_VENVS/torch-<version> (default ~/.cache/minizero/torch-venvs): torch ==
# <version>, its torchvision (0.(minor+15)), DeepSpeed within pyproject's dev range, pytest.
# pip's own variables say where torch comes from: PyPI's Linux torch is a CUDA build (about
# 3 GB with its CUDA libraries, fine on a CPU); PIP_INDEX_URL=https://download.pytorch.org/whl/cpu
# gets the CPU build (about 200 MB) where that index is reachable; torchvision must come
# from the same place (a CPU torch beside PyPI's torchvision fails as the ranks start:
# "operator torchvision::nms does not exist"). An existing environment is reused as it is:
# give its folder as MINIZERO_TORCH_VENV to use one you made yourself.
# DeepSpeed's C++ ops are built per torch (an op built against another torch does not
# load): into the environment's own torch_extensions/ folder, on first use.
#
# The version-sensitive tests: the torch names the repository uses (test_torch_versions.py),
# the group timeout (test_desync.py: torch.distributed.set_timeout is 2.14+), every ZeRO stage
# (gradient hooks, storage resizing), activation checkpointing (autocast state, pytree),
# offload, overlap, checkpoints (torch.load with mmap), adam.py's own foreach AdamW against
# that torch's AdamW (test_adam.py), FSDP2/DDP and DeepSpeed agreement on that torch, the
# training command line and the rank launcher. The versions they passed under, with the
# date, machine and counts: docs/results/torch-versions.md.
set -euo pipefail
cd "$(dirname "$0")/../.."

if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
    sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 2
fi
version="$1"; shift
if ! [[ "$version" =~ ^2\.([0-9]+)\.[0-9]+$ ]]; then
    echo "other_torch.sh: torch version $version: give a release as MAJOR.MINOR.PATCH, e.g. 2.11.0" >&2
    exit 2
fi
minor="${BASH_REMATCH[1]}"

VERSION_SENSITIVE=(
    tests/tools/test_torch_versions.py
    tests/tools/test_desync.py
    tests/core/test_engine.py
    tests/core/test_adam.py
    tests/core/test_checkpointing.py
    tests/core/test_offload.py
    tests/core/test_overlap.py
    tests/core/test_teardown.py
    tests/tools/test_spawn.py
    tests/tools/test_checkpoint_io.py
    tests/tools/test_train.py
    tests/agreement/test_agreement_torch.py
    tests/agreement/test_agreement_loss.py
)
if [ $# -eq 0 ] || { [[ "$1" == -* ]] && [ "$1" != "--all" ]; }; then
    tests=("${VERSION_SENSITIVE[@]}" "$@")   # pytest options after the version: added to these tests
elif [ "$1" = "--all" ]; then
    shift
    tests=(tests "$@")
else
    tests=("$@")
fi

venv="${MINIZERO_TORCH_VENV:-${MINIZERO_TORCH_VENVS:-$HOME/.cache/minizero/torch-venvs}/torch-$version}"
if [ ! -x "$venv/bin/python" ]; then
    echo "other_torch.sh: making $venv (torch $version)" >&2
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q "torch==$version" "torchvision==0.$((minor + 15)).*" \
        "deepspeed>=0.16,<0.20" "numpy>=1.24" "tqdm>=4.60" "pytest>=7" "pytest-xdist>=3" "matplotlib>=3.6"
fi
have="$("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
if [[ "$have" != "$version" && "$have" != "$version+"* ]]; then
    echo "other_torch.sh: $venv holds torch $have, not $version" >&2
    exit 2
fi
mkdir -p "$venv/torch_extensions"
echo "other_torch.sh: torch $have ($venv/bin/python) on $(git rev-parse --short HEAD 2>/dev/null || echo '?')" >&2
export DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$venv/torch_extensions"
exec "$venv/bin/python" -m pytest -p no:cacheprovider -n "${MINIZERO_TEST_WORKERS:-2}" "${tests[@]}"
