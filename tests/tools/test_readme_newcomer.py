"""What the README tells a newcomer at the points where one got stuck (each assertion is a
sentence that was missing): what samples.png shows, that the quick-start run needs a new
--save-dir to run twice, that bf16 numbers in the compare table vary by machine, why the
venv is 5.6 GB and how to install CPU-only torch, and where the real error line is under
torchrun."""
from __future__ import annotations

import os
import re

from tests.tools.test_train import ROOT

README = open(os.path.join(ROOT, "README.md")).read()


def test_samples_png_is_explained():
    assert re.search(r"`samples\.png` is a grid of `--num-samples`", README)
    assert "first pixel" in README and "--top-k" in README


def test_quick_start_says_a_second_run_needs_a_new_save_dir():
    before = README.split("-m minizero.train --stage 3\n", 1)[0]
    comment = before.splitlines()[-2]   # the line above the command: its comment
    assert "refused" in comment and "--save-dir" in comment, comment


def test_compare_output_says_bf16_numbers_vary_by_machine():
    section = README.split("### Compare with DeepSpeed", 1)[1].split("| stage |", 1)[0]
    assert "bf16 numbers vary by machine" in section


def test_venv_size_and_cpu_only_torch():
    assert "5.6 GB" in README and "CUDA libraries" in README
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in README


def test_where_the_error_line_is_under_torchrun():
    assert "ChildFailedError" in README and "Root Cause" in README
