"""--n-embd / --n-head / --image-size: a large preset shrunk for a CPU, the same flags in
minizero.train and reference/train.py (one parser, minizero.train.train_args), one printed line
naming the preset and every size changed, and one clear line for a size that cannot be.

The end-to-end case is the tutorial's step 5 as issue 11 asks for it on a CPU: the step-5
config on 2 ranks with the 24-layer model at width 32 and 8x8 images (63 tokens),
micro-batch 2 instead of 128 (the config's 4 accumulation steps kept).
"""
from __future__ import annotations

import json
import os

import pytest

from minizero.gpt.model import GPT, PRESETS
from minizero.train.train_args import build_parser, check_args, model_config
from tests.support.command_runs import run_command

def parse(*argv):
    parser = build_parser()
    args = parser.parse_args(list(argv))
    check_args(parser, args)
    return args


# ----------------------------------------------------------------------------- the flags, in-process

def test_n_embd_and_image_size_shrink_the_preset_and_keep_its_depth():
    args = parse("--model", "tutorial-24", "--n-embd", "32", "--image-size", "8", "--dataset", "synthetic")
    cfg = model_config(args)
    preset = PRESETS["tutorial-24"]
    assert (cfg.n_embd, cfg.block_size) == (32, 8 * 8 - 1)
    assert (cfg.n_layer, cfg.n_head, cfg.vocab_size) == (preset.n_layer, preset.n_head, preset.vocab_size) == (24, 8, 512)
    assert (cfg.embd_pdrop, cfg.resid_pdrop, cfg.attn_pdrop) == (0.0, 0.0, 0.0)
    assert args.model_note == ("model tutorial-24 with n_embd=32 (--n-embd), block_size=63 (--image-size 8) "
                               "instead of the preset's n_embd=256, block_size=1023")
    # every block is 12 E^2 + 13 E; plus the embeddings (V + T) E, the final LayerNorm 2E and the head E V
    E, T, V = 32, 63, 512
    assert GPT(cfg).num_params() == 24 * (12 * E * E + 13 * E) + (V + T) * E + 2 * E + E * V == 339_744


def test_n_head_and_ncluster_are_named_too():
    args = parse("--model", "tutorial", "--n-embd", "48", "--n-head", "3", "--image-size", "32",
                 "--dataset", "synthetic", "--ncluster", "64")
    cfg = model_config(args)
    assert (cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.block_size, cfg.n_layer) == (48, 3, 64, 1023, 12)
    assert args.model_note == ("model tutorial with n_embd=48 (--n-embd), n_head=3 (--n-head), vocab_size=64 "
                               "(--ncluster 64) instead of the preset's n_embd=256, n_head=8, vocab_size=512")


@pytest.mark.parametrize("argv", [["--model", "tutorial-24", "--image-size", "32", "--dataset", "cifar10"],
                                  ["--model", "tiny", "--image-size", "8", "--dataset", "synthetic"]])
def test_the_preset_as_it_is_prints_nothing(argv):
    args = parse(*argv)
    assert args.model_note is None and model_config(args) == PRESETS[args.model]


@pytest.mark.parametrize("argv,needle", [
    (["--n-embd", "30"], "--n-embd 30: n_embd 30 must be divisible by n_head 8 (--model tutorial-24 has n_embd 256, "
                         "n_head 8); pick --n-embd as a multiple of n_head, or pass --n-head"),
    (["--n-head", "5"], "--n-head 5: n_embd 256 must be divisible by n_head 5"),
    (["--n-embd", "32", "--n-head", "3"], "--n-embd 32 --n-head 3: n_embd 32 must be divisible by n_head 3"),
    (["--n-embd", "0"], "--n-embd must be >= 1, got 0"),
    (["--n-head", "-2"], "--n-head must be >= 1, got -2"),
])
def test_bad_sizes_are_one_clear_line(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        parse("--model", "tutorial-24", "--image-size", "8", "--dataset", "synthetic", *argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err


def test_help_lists_the_flags_in_model_and_data():
    text = build_parser().format_help()
    group = text[text.index("model and data:"):text.index("run:")]
    assert "--n-embd N" in group and "--n-head N" in group and "tutorial-24" in group


# ----------------------------------------------------------------------------- step 5 on a CPU, both libraries

# One optimizer step (4 micro-steps of 2 rows: the config's accumulation runs whole) is all the
# assertions need: the shrunk model built, the config read, the run completed under both
# libraries. 2 rows: what --micro-batch promises is that it replaces the config's 128, which
# any value shows, and more rows only add arithmetic to DeepSpeed's hooks around 24 layers.
# 128 training images: one step's 16 rows (2 x 4 x 2 ranks), and 640 pixels for the 512-colour
# k-means (5 per image; 103 images is its floor). 4 test images: one evaluation batch of 2 per
# rank. No sample: sampling is 63 forwards through 24 hooked layers (a third of
# DeepSpeed's run, cProfile of rank 0); its forwards without backward under ZeRO-3 with both
# offloads are the test loss's, which tests/tools/test_compare.py's offload run asserts equal
# in both libraries, and minizero's grid under ZeRO-3 is tests/tools/test_train.py's.
STEP5 = ["--config", "launch/ds_config_step5.json", "--model", "tutorial-24", "--n-embd", "32", "--image-size", "8",
         "--micro-batch", "2", "--max-steps", "1", "--dataset", "synthetic", "--synthetic-train", "128",
         "--synthetic-test", "4", "--num-samples", "0"]
NOTE = ("model tutorial-24 with n_embd=32 (--n-embd), block_size=63 (--image-size 8) instead of the preset's "
        "n_embd=256, block_size=1023")


@pytest.fixture(scope="module")
def step5_runs(tmp_path_factory):
    """The same command under both libraries, one after the other (2 ranks each, as
    `torchrun --nproc-per-node 2` starts them, forked from the tests' preloaded forkserver:
    tests/support/command_runs.py)."""
    tmp = tmp_path_factory.mktemp("step5")
    out = {}
    for library, program in (("minizero", "minizero.train"), ("deepspeed", "reference/train.py")):
        save = str(tmp / library)
        p = run_command(program, [*STEP5, "--data-dir", str(tmp / "data"), "--save-dir", save], nproc=2,
                        env={"DS_ACCELERATOR": "cpu"})
        assert p.returncode == 0, f"{' '.join(p.args)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
        with open(os.path.join(save, "summary.json")) as f:
            out[library] = (p.stdout, json.load(f))
    return out


@pytest.mark.parametrize("library", ["minizero", "deepspeed"])
def test_step5_on_cpu_runs_shrunk_and_says_so(step5_runs, library):
    stdout, s = step5_runs[library]
    assert stdout.count(NOTE) == 1, stdout            # rank 0 only
    assert (s["status"], s["stage"], s["dtype"], s["world_size"], s["steps"]) == ("completed", 3, "fp16", 2, 1)
    assert s["model"] == "tutorial-24" and s["params"] == 339_744
    assert s["config"]["gradient_accumulation_steps"] == 4 and s["config"]["train_micro_batch_size_per_gpu"] == 2
    zero = s["config"]["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu"} and zero["offload_param"] == {"device": "cpu"}
