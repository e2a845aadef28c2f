"""What the README tells a newcomer at the points where one got stuck (each assertion is a
sentence that was missing): the two commands and the self-check below them, what
samples.png shows, that the training command needs a new --save-dir to run twice, that bf16
numbers of the comparison vary by machine, why the venv is 5.6 GB and how to install
CPU-only torch, and where the real error line is under torchrun."""
from __future__ import annotations

import os
import re

from tests.tools.test_train import ROOT

README = open(os.path.join(ROOT, "README.md")).read()


def test_samples_png_is_explained():
    assert re.search(r"`samples\.png` is a grid of `--num-samples`", README)
    assert "first pixel" in README and "--top-k" in README


def two_commands() -> list[str]:
    """The command lines of the README's first code block (under "## Two commands")."""
    block = README.split("## Two commands", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [x.split("#")[0].strip() for x in block.splitlines() if x.strip()]


def test_two_commands_install_and_test_then_train():
    """Issue 41: two commands, not five (install, selftest, build_ops, pytest, train)."""
    assert two_commands() == [
        "./test.sh",
        "source .venv/bin/activate && torchrun --standalone --nproc-per-node 2 -m minizero.train --stage 3"]


def test_the_selftest_is_one_line_below_for_a_machine_where_the_suite_is_too_much():
    after = README.split("## Two commands", 1)[1].split("```bash\n", 1)[1].split("```", 1)[1]
    first_paragraph = after.strip().split("\n\n", 1)[0]
    assert "./test.sh --selftest" in first_paragraph and "python -m minizero.selftest" in first_paragraph
    assert "too much" in first_paragraph


def test_the_training_command_says_a_second_run_needs_a_new_save_dir():
    section = README.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    said = " ".join(section.split())
    assert "runs/minizero-3-fp32/" in said and "Run again, it is refused" in said and "--save-dir" in said


def test_compare_output_says_bf16_numbers_vary_by_machine():
    section = README.split("### Compare with DeepSpeed", 1)[1].split("\n### ", 1)[0]
    assert "bf16 numbers vary by machine" in section


def test_venv_size_and_cpu_only_torch():
    assert "5.6 GB" in README and "CUDA libraries" in README
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in README


def test_where_the_error_line_is_under_torchrun():
    assert "ChildFailedError" in README and "Root Cause" in README
